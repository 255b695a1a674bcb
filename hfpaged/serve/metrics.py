"""Prometheus metrics of one server (``GET /metrics``), in its own registry so servers do not collide."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _PoolCollector:
    """Reads the engine's latest ``hfpaged.stats`` snapshot at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        yield GaugeMetricFamily(
            "hfpaged_kv_cache_usage_ratio", "Share of KV blocks in use (0..1).", value=stats.get("gpu_cache_usage", 0.0)
        )
        yield GaugeMetricFamily(
            "hfpaged_kv_cache_num_blocks", "KV blocks in the pool.", value=stats.get("num_blocks", 0)
        )
        yield GaugeMetricFamily(
            "hfpaged_kv_cache_num_free_blocks",
            "Free (or evictable cached) KV blocks.",
            value=stats.get("num_free_blocks", 0),
        )
        yield GaugeMetricFamily(
            "hfpaged_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / looked up.",
            value=hits / queries if queries else 0.0,
        )
        yield CounterMetricFamily(
            "hfpaged_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=queries
        )
        yield CounterMetricFamily("hfpaged_prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=hits)
        yield CounterMetricFamily(
            "hfpaged_num_preemptions",
            "Requests preempted for lack of KV blocks.",
            value=stats.get("num_preemptions", 0),
        )


class ServerMetrics:
    """Request counts, token counters and latency histograms; ``render`` gives the Prometheus text."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
    ):
        self.registry = CollectorRegistry()
        registry = self.registry
        Gauge("hfpaged_num_requests_running", "Requests generating tokens.", registry=registry).set_function(
            num_running
        )
        Gauge(
            "hfpaged_num_requests_waiting", "Requests accepted that have no token yet.", registry=registry
        ).set_function(num_waiting)
        self.prompt_tokens = Counter("hfpaged_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry)
        self.generation_tokens = Counter("hfpaged_generation_tokens", "Tokens generated.", registry=registry)
        self.requests_finished = Counter(
            "hfpaged_requests_finished",
            "Engine requests finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "hfpaged_requests_rejected", "HTTP requests refused, by status code.", ["status"], registry=registry
        )
        self.time_to_first_token = Histogram(
            "hfpaged_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first token.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "hfpaged_inter_token_latency_seconds",
            "Between consecutive tokens of one sequence.",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "hfpaged_e2e_request_latency_seconds",
            "From the HTTP request's arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=registry,
        )
        registry.register(_PoolCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
