"""Prometheus metrics of one server (``GET /metrics``), in its own registry so servers do not collide.

With several front-end processes (``api_server_count`` > 1) each counts what it serves and any of them may
answer a scrape, so they use prometheus_client's multiprocess mode: the server process gives them one fresh
``PROMETHEUS_MULTIPROC_DIR`` (set in their environment before they import prometheus_client), counters and
histograms live in memory-mapped files there, and a scrape sums every process's files
(``MultiProcessCollector``); the running/waiting gauges are set on change and summed over live processes
("livesum"). The pool figures and the engine loop's counters come from the engine's snapshot, which every
front end receives, so whichever answers shows the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    """Reads the engine's latest snapshot (``hfpaged.stats`` + the engine loop's counters) at scrape time."""

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
        loop_seconds = CounterMetricFamily(
            "hfpaged_engine_loop_seconds",
            "Engine thread time by part: step (Engine.step), commands (adds, aborts), outputs (packing and "
            "sending them to the front ends), idle (nothing to do; counted when it wakes).",
            labels=["part"],
        )
        for part, seconds in stats.get("engine_loop_seconds", {}).items():
            loop_seconds.add_metric([part], seconds)
        yield loop_seconds
        yield CounterMetricFamily(
            "hfpaged_engine_loop_steps", "Engine steps run by the server.", value=stats.get("engine_loop_steps", 0)
        )


class ServerMetrics:
    """Request counts, token counters and latency histograms; ``render`` gives the Prometheus text.

    ``api_server_index``: which front-end process this is (the label of ``hfpaged_api_server_requests_total``);
    ``multiprocess_dir``: the shared ``PROMETHEUS_MULTIPROC_DIR`` when there are several (see the module).
    """

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        *,
        api_server_index: int = 0,
        multiprocess_dir: str | None = None,
    ):
        self.multiprocess_dir = multiprocess_dir
        self.num_running, self.num_waiting = num_running, num_waiting
        # multiprocess: the metric objects write to files; a registry of their own keeps them out of scrapes
        registry = self.registry = CollectorRegistry()
        running = Gauge(
            "hfpaged_num_requests_running",
            "Requests generating tokens.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        waiting = Gauge(
            "hfpaged_num_requests_waiting",
            "Requests accepted that have no token yet.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        if multiprocess_dir is None:
            running.set_function(num_running)
            waiting.set_function(num_waiting)
        self.running, self.waiting = running, waiting
        self.prompt_tokens = Counter("hfpaged_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry)
        self.generation_tokens = Counter("hfpaged_generation_tokens", "Tokens generated.", registry=registry)
        self.requests_finished = Counter(
            "hfpaged_requests_finished",
            "Engine requests finished, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "hfpaged_requests_rejected",
            "HTTP requests refused, by status code (499: the client left while sending its body).",
            ["status"],
            registry=registry,
        )
        self.api_server_requests = Counter(
            "hfpaged_api_server_requests",
            "API requests accepted, by front-end process (0 .. api_server_count - 1).",
            ["api_server"],
            registry=registry,
        ).labels(str(api_server_index))
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
        if multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self.scraped = CollectorRegistry()
            MultiProcessCollector(self.scraped, path=multiprocess_dir)
        else:
            self.scraped = registry
        self.scraped.register(_EngineCollector(stats))

    def update_counts(self) -> None:
        """Publish the running/waiting counts (multiprocess mode; otherwise they are read at scrape time)."""
        if self.multiprocess_dir is not None:
            self.running.set(self.num_running())
            self.waiting.set(self.num_waiting())

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.scraped), CONTENT_TYPE_LATEST
