"""CUDA graphs of the patched forward for decode steps, one per batch-size bucket.

Each graph replays the whole model body plus the LM head for ``bucket`` one-token requests, reading
its inputs from static device buffers and writing logits into a static output. The per-token part of
the packed layout (``step_inputs``) lives in one small buffer; the block tables live in their own
``[max_bucket, width]`` buffer, of which a step writes only the ``[batch, used columns]`` corner
(the kernel never reads past a sequence's blocks). Graphs are captured largest first into one
shared memory pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from .attention import AttentionMetadata
from .input_batch import DeviceStep, packed_size, region_slices, tables_offset

logger = logging.getLogger("hfpaged")


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    buckets += list(range(8, max_num_seqs + 1, 8))
    if not buckets or buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return sorted(set(buckets))


class DecodeGraphs:
    """Captured decode forwards keyed by batch bucket."""

    def __init__(self, device: torch.device, max_num_seqs: int, width: int, max_seqlen_k: int):
        self.width = width  # block-table columns every graph may read
        self.max_seqlen_k = max_seqlen_k  # the attention grid hint baked into the graphs
        self.buckets = batch_buckets(max_num_seqs)
        self.device = device
        largest = self.buckets[-1]
        self.static = torch.zeros(packed_size(largest, largest, 0), dtype=torch.int32, device=self.device)
        self.static_block_tables = torch.zeros(largest, width, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, num_reqs: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= num_reqs:
                return bucket
        return None

    def _dummy_inputs(self, bucket: int) -> np.ndarray:
        packed = np.zeros(packed_size(bucket, bucket, 0), dtype=np.int32)
        at = region_slices(bucket, bucket)
        packed[at["slot_mapping"]] = -1  # store nothing
        packed[at["logits_indices"]] = np.arange(bucket)
        packed[at["seq_lens"]] = 1
        packed[at["cu_seqlens_q"]] = np.arange(bucket + 1)
        return packed

    def _views(self, bucket: int) -> DeviceStep:
        """The step tensors of a ``bucket``-request decode, as views of the static buffers."""
        flat, at = self.static, region_slices(bucket, bucket)
        metadata = AttentionMetadata(
            slot_mapping=flat[at["slot_mapping"]],
            block_tables=self.static_block_tables[:bucket],
            seq_lens=flat[at["seq_lens"]],
            cu_seqlens_q=flat[at["cu_seqlens_q"]],
            max_seqlen_q=1,
            max_seqlen_k=self.max_seqlen_k,
        )
        return DeviceStep(
            flat[at["input_ids"]].long()[None],
            flat[at["positions"]].long()[None],
            metadata,
            flat[at["logits_indices"]].long(),
        )

    @torch.inference_mode()
    def capture(self, forward: Callable[[DeviceStep], torch.Tensor]) -> None:
        """Capture ``forward`` for every bucket (largest first, one shared pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in reversed(self.buckets):
            dummy = torch.from_numpy(self._dummy_inputs(bucket))
            self.static[: dummy.numel()].copy_(dummy)
            self.static_block_tables.zero_()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms
                    forward(self._views(bucket))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bucket] = forward(self._views(bucket))
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("hfpaged: captured %d decode CUDA graphs (batch %s)", len(self.graphs), self.buckets)

    def load(self, packed_host: torch.Tensor, bucket: int, width: int) -> None:
        """Copy a packed decode step (built for ``bucket`` rows and ``width`` block columns) into the static buffers."""
        small = tables_offset(bucket, bucket)
        self.static[:small].copy_(packed_host[:small], non_blocking=True)
        self.static_block_tables[:bucket, :width].copy_(packed_host[small:].view(bucket, width), non_blocking=True)

    def input_ids(self, bucket: int) -> torch.Tensor:
        """The static int32 input ids of ``bucket``'s graph (to patch in tokens that are already on the device)."""
        return self.static[region_slices(bucket, bucket)["input_ids"]]

    def replay(self, bucket: int, num_sampled: int) -> torch.Tensor:
        """Replay the graph of ``bucket`` on the loaded inputs; logits ``[num_sampled, vocab]``."""
        self.graphs[bucket].replay()
        return self.outputs[bucket][:num_sampled]
