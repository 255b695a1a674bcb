"""CUDA graphs of the patched forward: decode steps by batch bucket, mixed and prefill steps by token bucket.

Each graph replays the whole model body plus the LM head for a fixed shape (T tokens from R requests),
reading its inputs from static device buffers and writing logits into a static output. The per-token part
of the packed layout (``step_inputs``) lives in one small buffer; the block tables live in their own
``[max R, width]`` buffer, of which a step writes only the ``[R, used columns]`` corner (the kernel never
reads past a sequence's blocks). A step smaller than its bucket is padded (``InputBatch.pack``): padding
sequences own the padding tokens, store nothing (slot -1) and are not sampled; sequences past them have no
query tokens at all.

Decode graphs (T = R = the batch bucket) keep one output each. Mixed graphs (T = a token bucket, R =
min(T, max_num_seqs + 1): any step of at most T tokens fits, with a sequence to spare for the padding)
attend with the prefill tiles (the attention's ``max_seqlen_q`` hint is T) and copy their logits into one
output shared by all of them, so the logits of the largest bucket are not held once per bucket. Graphs of
one kind are captured largest first into one shared memory pool. Where the attention's prompt tiles differ for
short and long query runs (``short_prompt_hint``), a mixed bucket above the short-run limit has a second graph,
captured with that limit as its hint: a step whose longest query run is within it replays that one (chat steps
of short prompts beside decode rows: ~1.5x faster attention than with the long-prompt tiles).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from ..core.block_pool import cdiv
from ..sampling.sampler import FEW_ROWS, row_argmax
from .attention import AttentionMetadata
from .input_batch import (
    DeviceStep,
    packed_size,
    padded_width,
    region_slices,
    tables_offset,
    widen_leading_regions,
)

logger = logging.getLogger("hfpaged")


def batch_buckets(max_num_seqs: int, min_batch: int = 1) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself); ``min_batch=2`` leaves
    out 1 (a lone sequence then pads into the 2-row graph) unless max_num_seqs is 1."""
    buckets = [b for b in (1, 2, 4) if min_batch <= b < max_num_seqs]
    buckets += list(range(8, max_num_seqs + 1, 8))
    if not buckets or buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """16, 32, 64, ... 512, then steps of 1.5x and 2x (768, 1024, 1536, 2048, ...) up to max_num_batched_tokens."""
    buckets, t = [], 16
    while t < max_num_batched_tokens:
        buckets.append(t)
        if t >= 512:
            buckets.append(t * 3 // 2)
        t *= 2
    buckets = [b for b in buckets if b < max_num_batched_tokens] + [max_num_batched_tokens]
    return sorted(set(buckets))


def _end_failed_capture(device: torch.device, pool) -> None:
    """torch ends a capture's routing of allocations to its pool only after cudaStreamEndCapture succeeds: a capture
    invalidated inside leaves the allocator believing it still runs, and then it never frees cached memory
    (``empty_cache`` does nothing, every later pool piles up) and refuses that pool. End the routing by hand; where
    the capture did end properly this raises "not currently recording", which is fine."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None
    )
    if end is None:
        return
    with contextlib.suppress(RuntimeError):
        end(device.index if device.index is not None else torch.cuda.current_device(), pool)


def short_prompt_hint(layers) -> int | None:
    """The hint of the mixed graphs' short-prompt variants for these attention layers (``LayerRecord``), or None
    where no layer's prompt tiles depend on the query run length."""
    from ..kernels._checks import next_power_of_2  # CUDA graphs run the Triton kernels
    from ..kernels.attention_config import short_prompt_hint as layer_hint

    for layer in layers:
        head_dim_pad = next_power_of_2(max(layer.head_dim, layer.head_dim_v))  # as paged_attention pads it
        group = layer.num_heads // layer.num_kv_heads
        hint = layer_hint(group=group, head_dim_pad=head_dim_pad, elem_size=layer.dtype.itemsize)
        if hint is not None:
            return hint
    return None


class StepGraphs:
    """Captured forwards keyed by bucket: decode (``mixed=False``: T = R = bucket) or mixed (T = bucket)."""

    def __init__(
        self,
        device: torch.device,
        max_num_seqs: int,
        width: int,
        block_size: int,
        *,
        mixed: bool = False,
        max_num_tokens: int | None = None,
        min_batch: int = 1,
        warm_smallest: bool = False,
        short_prompt_hint: int | None = None,
    ):
        self.width = width  # block-table columns of a real request (longer ones run eagerly)
        self.max_seqlen_k = width * block_size  # the attention grid hint baked into the graphs
        self.mixed = mixed
        self.max_num_seqs = max_num_seqs
        self.buckets = token_buckets(max_num_tokens) if mixed else batch_buckets(max_num_seqs, min_batch)
        # mixed: buckets with a second graph baking the short-prompt tiles (hint = the short-run limit)
        self.short_hint = short_prompt_hint if mixed else None
        self.short_buckets = [b for b in self.buckets if self.short_hint is not None and b > self.short_hint]
        self.short_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.device = device
        largest_tokens, largest_reqs = self.shape(self.buckets[-1])
        self.static = torch.zeros(packed_size(largest_tokens, largest_reqs, 0), dtype=torch.int32, device=device)
        # a padding sequence of up to T tokens reads cdiv(T, block_size) columns of its row (block 0 or stale ids)
        table_width = max(width, padded_width(cdiv(largest_tokens, block_size)))
        self.static_block_tables = torch.zeros(largest_reqs, table_width, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # greedy picks of the output rows, computed inside the graph for buckets of few rows (whose argmax is a
        # few us of GPU time but ~75 us of host time when launched eagerly); None where the rows are many
        self.greedy: dict[int, torch.Tensor | None] = {}
        self.capture_retries = 0  # buckets whose capture without a warm-up failed (then warmed up and captured)
        # the smallest bucket warms up before its capture too (compiled layers meeting batch 1: dynamo specialises
        # size 1 and compiles again, which must not happen inside a capture)
        self.warm_smallest = warm_smallest

    def shape(self, bucket: int) -> tuple[int, int]:
        """(tokens, requests) of ``bucket``'s graph."""
        return (bucket, min(bucket, self.max_num_seqs + 1)) if self.mixed else (bucket, bucket)

    def bucket_for(self, num_tokens: int, num_reqs: int) -> int | None:
        """The smallest bucket a step of ``num_tokens`` tokens from ``num_reqs`` requests fits, or None: its
        requests must fit the graph's, with one to spare for the padding tokens if there are any (beam rows
        can outnumber max_num_seqs: such a step may fit no graph and run eagerly)."""
        for bucket in self.buckets:
            bucket_tokens, bucket_reqs = self.shape(bucket)
            if bucket_tokens < num_tokens or bucket_reqs < num_reqs:
                continue
            if bucket_tokens > num_tokens and bucket_reqs == num_reqs:
                continue  # the padding tokens would have no sequence
            return bucket
        return None

    def _dummy_inputs(self, bucket: int) -> np.ndarray:
        """One sequence per token (decode), or one sequence holding every token (mixed); nothing stored; every
        position 0 (within any model's position table, as padding tokens are)."""
        num_tokens, num_reqs = self.shape(bucket)
        packed = np.zeros(packed_size(num_tokens, num_reqs, 0), dtype=np.int32)
        at = region_slices(num_tokens, num_reqs)
        packed[at["slot_mapping"]] = -1  # store nothing
        packed[at["logits_indices"]] = np.arange(num_reqs)
        if self.mixed:
            packed[at["seq_lens"]][0] = num_tokens
            packed[at["cu_seqlens_q"]][1:] = num_tokens
        else:
            packed[at["seq_lens"]] = 1
            packed[at["cu_seqlens_q"]] = np.arange(num_reqs + 1)
        return packed

    def _views(self, bucket: int, hint: int | None = None) -> DeviceStep:
        """The step tensors of ``bucket``'s graph (``hint``: its max_seqlen_q, else the bucket's), as views of the
        static buffers."""
        num_tokens, num_reqs = self.shape(bucket)
        flat, at = self.static, region_slices(num_tokens, num_reqs)
        metadata = AttentionMetadata(
            slot_mapping=flat[at["slot_mapping"]],
            block_tables=self.static_block_tables[:num_reqs],
            seq_lens=flat[at["seq_lens"]],
            cu_seqlens_q=flat[at["cu_seqlens_q"]],
            # mixed: the prefill tiles (right for any query runs; which ones, the hint says), decode: the decode tiles
            max_seqlen_q=(hint or num_tokens) if self.mixed else 1,
            max_seqlen_k=self.max_seqlen_k,
        )
        wide = widen_leading_regions(flat, at)
        return DeviceStep(
            wide[at["input_ids"]][None], wide[at["positions"]][None], metadata, wide[at["logits_indices"]]
        )

    @torch.inference_mode()
    def capture(self, forward: Callable[[DeviceStep], torch.Tensor]) -> None:
        """Capture ``forward`` for every bucket (largest first, one shared pool). Only the first (largest) bucket
        warms up outside the capture, twice (lazy initialisation, torch.compile, cuBLAS's first use of the
        stream); later buckets only meet a new shape and are captured straight away (a graph start spends ~20 ms
        of host time per warm-up call, ~1 s over both ladders), unless that capture fails: then they warm up once
        and capture again (``warm_smallest``: the smallest warms up once first)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        shared = None  # mixed: the one logits buffer every graph copies into (outside the graph pool)
        for bucket in reversed(self.buckets):
            dummy = torch.from_numpy(self._dummy_inputs(bucket))
            self.static[: dummy.numel()].copy_(dummy)
            self.static_block_tables.zero_()
            for hint in [None] + ([self.short_hint] if bucket in self.short_buckets else []):
                if bucket == self.buckets[-1] and hint is None:
                    logits = self._warm_up(forward, bucket, stream, calls=2)
                    if self.mixed:
                        shared = torch.empty_like(logits)
                    del logits
                    entry = self._capture_one(forward, bucket, pool, stream, shared)
                else:
                    if self.warm_smallest and bucket == self.buckets[0]:
                        self._warm_up(forward, bucket, stream, calls=1)
                    try:
                        entry = self._capture_one(forward, bucket, pool, stream, shared, hint)
                    except RuntimeError as error:
                        logger.info(
                            "hfpaged: capture of bucket %d failed without a warm-up (%s); retrying", bucket, error
                        )
                        self.capture_retries += 1
                        # the retry and the buckets after it capture into a fresh pool, on a fresh stream (the failed
                        # capture may have left its own half-used)
                        pool = torch.cuda.graph_pool_handle()
                        stream = torch.cuda.Stream(self.device)
                        self._warm_up(forward, bucket, stream, calls=1, hint=hint)
                        entry = self._capture_one(forward, bucket, pool, stream, shared, hint)
                if hint is None:
                    self.graphs[bucket], self.outputs[bucket], self.greedy[bucket] = entry
                else:
                    self.short_graphs[bucket] = entry
        torch.cuda.synchronize(self.device)
        kind = "mixed-step (tokens" if self.mixed else "decode (batch"
        logger.info("hfpaged: captured %d %s CUDA graphs %s)", len(self.graphs), kind, self.buckets)

    def _warm_up(self, forward, bucket: int, stream: torch.cuda.Stream, calls: int, hint=None) -> torch.Tensor:
        """Run ``forward`` on ``bucket``'s views outside any capture; the last call's logits."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(calls):
                logits = forward(self._views(bucket, hint))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return logits

    def _capture_one(self, forward, bucket: int, pool, stream: torch.cuda.Stream, shared, hint: int | None = None):
        """One bucket's graph (``hint``: its max_seqlen_q, else the bucket's), its output (mixed: a view of
        ``shared``, the buffer every graph copies into) and the output rows' argmax (None for buckets of many
        rows)."""
        graph = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            # thread_local: other threads (stock generate, another model) may keep using the GPU meanwhile
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                logits = forward(self._views(bucket, hint))
                if self.mixed:
                    shared[: logits.shape[0]].copy_(logits)
                    logits = shared[: logits.shape[0]]
                greedy = row_argmax(logits) if logits.shape[0] < FEW_ROWS else None
        except BaseException:
            _end_failed_capture(self.device, pool)  # else the allocator would stop freeing cached memory for good
            raise
        return graph, logits, greedy

    def load(self, packed_host: torch.Tensor, bucket: int, width: int) -> None:
        """Copy a packed step (built for ``bucket``'s shape and ``width`` block columns) into the static buffers."""
        num_tokens, num_reqs = self.shape(bucket)
        small = tables_offset(num_tokens, num_reqs)
        self.static[:small].copy_(packed_host[:small], non_blocking=True)
        tables = packed_host[small:].view(num_reqs, width)
        self.static_block_tables[:num_reqs, :width].copy_(tables, non_blocking=True)

    def input_ids(self, bucket: int) -> torch.Tensor:
        """The static int32 input ids of ``bucket``'s graph (to patch in tokens that are already on the device)."""
        return self.static[region_slices(*self.shape(bucket))["input_ids"]]

    def variant_hint(self, bucket: int, max_seqlen_q: int | None) -> int | None:
        """The hint of the graph that a step of ``bucket`` whose longest query run is ``max_seqlen_q`` replays: the
        short-prompt variant's where the bucket has one and the run fits it, else None (the bucket's own graph)."""
        if max_seqlen_q is not None and bucket in self.short_buckets and max_seqlen_q <= self.short_hint:
            return self.short_hint
        return None

    def greedy_tokens(self, bucket: int, num_sampled: int, max_seqlen_q: int | None = None) -> torch.Tensor | None:
        """The argmax of the rows ``replay`` returned (same ``max_seqlen_q``), computed by the graph (None for buckets
        of many rows). It is overwritten by the bucket's next replay: read it (or enqueue its reads) before that."""
        if self.variant_hint(bucket, max_seqlen_q) is not None:
            greedy = self.short_graphs[bucket][2] if bucket in self.short_graphs else None
        else:
            greedy = self.greedy.get(bucket)
        return None if greedy is None else greedy[:num_sampled]

    def replay(self, bucket: int, num_sampled: int, max_seqlen_q: int | None = None) -> torch.Tensor:
        """Replay the graph of ``bucket`` on the loaded inputs (``max_seqlen_q``: the step's longest query run, which
        may pick the short-prompt variant); logits ``[num_sampled, vocab]``."""
        if self.variant_hint(bucket, max_seqlen_q) is not None:
            graph, output, _ = self.short_graphs[bucket]
        else:
            graph, output = self.graphs[bucket], self.outputs[bucket]
        graph.replay()
        return output[:num_sampled]
