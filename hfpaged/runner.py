"""Turns a SchedulerOutput into one packed forward of the unmodified model and returns last-token logits.

Eager steps (any prefill) run the HF forward directly. Pure decode steps on CUDA replay a captured
CUDA graph of the same forward (see cuda_graphs.py). Either way the step's inputs cross to the
device in ONE copy (step_inputs.py) and nothing inside the forward synchronizes with the host.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention import ATTENTION_NAME, ForwardContext, set_forward_context
from .cuda_graphs import DecodeGraphs
from .request import Request
from .scheduler import SchedulerOutput
from .step_inputs import DeviceStep, HostStep, build_host_step, device_views, region_slices

if TYPE_CHECKING:
    from .patch import PatchState


@contextmanager
def paged_mode(state: "PatchState", context: ForwardContext):
    """Route the model's attention to hfpaged for the duration of one forward.

    Only the configs' ``_attn_implementation`` is switched, and always switched back: outside this
    block the model runs exactly as it did before ``patch``.
    """
    saved = [cfg._attn_implementation_internal for cfg in state.attn_configs]
    for cfg in state.attn_configs:
        cfg._attn_implementation_internal = ATTENTION_NAME
    previous = set_forward_context(context)
    try:
        yield
    finally:
        set_forward_context(previous)
        for cfg, value in zip(state.attn_configs, saved):
            cfg._attn_implementation_internal = value


class ModelRunner:
    """Prepares inputs, runs the forward with the paged attention active, returns logits."""

    def __init__(self, model: torch.nn.Module, state: "PatchState"):
        self.model = model
        self.state = state
        self.device = state.input_device
        self.block_size = state.config.block_size
        self.supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.store_fn, self.attention_fn = state.attention_functions()
        self.single_device = all(layer.device == self.device for layer in state.layers)
        single_cuda_device = self.device.type == "cuda" and self.single_device
        self.use_graphs = (
            single_cuda_device
            and state.use_triton
            and not state.config.enforce_eager
            and self.supports_logits_to_keep
        )
        max_len = state.max_model_len or state.pool.num_blocks * self.block_size
        # a multiple of 16 columns: the kernels' block-table row stride keeps one Triton specialization
        self.graph_width = -(-min(math.ceil(max_len / self.block_size), state.pool.num_blocks) // 16) * 16
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        self._warmed = False
        self._compiled = None
        self.num_eager_steps = 0

    # --- host -> device ---------------------------------------------------------------------------

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a CPU tensor the device can copy from asynchronously (pinned, on CUDA).

        Each step stages into its own pinned block from torch's caching host allocator, which does not hand
        a block out again until the copies reading it have run: a step may be prepared while the one before
        is still in flight.
        """
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staged.copy_(host)
        return staged

    def _fill_pending(self, input_ids: torch.Tensor, pending: np.ndarray | None, previous: torch.Tensor | None) -> None:
        """Write the tokens sampled by the previous step (still on the device) into this step's int32 input ids."""
        if pending is None:
            return
        if previous is None:
            raise RuntimeError("a scheduled request waits for a token of a step that is not in flight")
        index = self._stage(pending).to(input_ids.device, non_blocking=True)
        values = previous.to(input_ids.device, non_blocking=True).index_select(0, index[1])
        input_ids.index_copy_(0, index[0], values.to(input_ids.dtype))

    # --- forward ----------------------------------------------------------------------------------

    def forward(self, step: DeviceStep, logits_indices: torch.Tensor | list[int] | int | None = None) -> torch.Tensor:
        """The unmodified model over a packed step with paged attention; logits ``[n, vocab]``."""
        context = ForwardContext(
            "paged",
            metadata=step.metadata,
            store_fn=self.store_fn,
            attention_fn=self.attention_fn,
        )
        kwargs = {}
        keep = step.logits_indices if logits_indices is None else logits_indices
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with paged_mode(self.state, context):
            output = self.model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                use_cache=False,
                **kwargs,
            )
        logits = output.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, keep.to(logits.device)) if isinstance(keep, torch.Tensor) else logits
        return logits

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile the Triton kernel variants a run will meet (decode tiles with and without context
        splits, mixed and prefill tiles) up front, instead of inside the first steps that need them."""
        if self._warmed or not self.state.use_triton or self.device.type != "cuda":
            self._warmed = True
            return
        self._warmed = True
        from .kernels.paged_attention import SEARCH_BLOCK_SEQ_COUNTS

        signatures: dict[tuple, int] = {}
        for index, layer in enumerate(self.state.layers):
            key = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.head_dim_v, layer.dtype,
                   layer.sliding_window, layer.softcap)
            signatures.setdefault(key, index)
        bs = self.block_size
        capacity = self.state.pool.num_blocks * bs
        budget = max(self.state.config.max_num_batched_tokens, 64)
        # The kernel's variants follow the tile config (from the longest query run and the split count) and
        # the sequence-search width (num_seqs < 64, < 256, or more): one batch of each kind, both with every
        # sequence at the same query length and with one long run among one-token decodes (mixed steps).
        max_seqs = self.state.config.max_num_seqs
        seq_counts = sorted({min(n, max_seqs) for n in SEARCH_BLOCK_SEQ_COUNTS})
        shapes = set()
        for q_len in (1, 2, 4, 8, 16, 32, 64, 256, 2048):
            for num_seqs in seq_counts:
                shapes.add((q_len,) * num_seqs)
                shapes.add((q_len,) + (1,) * (num_seqs - 1))
        for (num_heads, _, head_dim, _, dtype, window, softcap), index in signatures.items():
            k_cache, v_cache = self.state.kv_caches[index]
            device = k_cache.device
            for q_lens in sorted(shapes):
                max_q, num_seqs, num_tokens = max(q_lens), len(q_lens), sum(q_lens)
                context = min(max(max_q, 4096), capacity)
                if max_q > context or num_tokens > budget:
                    continue
                num_blocks = -(-context // bs)
                width = -(-num_blocks // 16) * 16  # as build_host_step pads it
                block_tables = torch.zeros(num_seqs, width, dtype=torch.int32, device=device)
                block_tables[:, :num_blocks] = torch.arange(num_blocks, dtype=torch.int32, device=device)
                seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
                cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
                q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
                self.attention_fn(q, k_cache, v_cache, block_tables, seq_lens, cu, scale=head_dim**-0.5,
                                  sliding_window=window, softcap=softcap, max_seqlen_q=max_q, max_seqlen_k=context)
                slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
                kv = torch.zeros(num_tokens, k_cache.shape[2], k_cache.shape[3], dtype=dtype, device=device)
                self.store_fn(kv, kv, k_cache, v_cache, slots)
        torch.cuda.synchronize(self.device)

    def _graph_forward(self, step: DeviceStep) -> torch.Tensor:
        if not self.state.config.compile:
            return self.forward(step, logits_indices=0)  # every token of a decode batch is sampled
        if self._compiled is None:
            from .compiled import compile_decode_forward

            self._compiled = compile_decode_forward(self.model, self.graph_width * self.block_size)
        meta = step.metadata  # reaches the attention as forward kwargs: no context metadata needed
        with paged_mode(self.state, ForwardContext("paged")):
            return self._compiled(step.input_ids, step.position_ids, meta.slot_mapping, meta.block_tables,
                                  meta.seq_lens, meta.cu_seqlens_q)

    def capture_graphs(self) -> None:
        """Capture the decode CUDA graphs now (otherwise done at the first decode step)."""
        if self.use_graphs and self.graphs is None:
            graphs = DecodeGraphs(self.state, self._graph_forward, self.graph_width, self.graph_width * self.block_size)
            graphs.capture()
            self.graphs = graphs

    def _graph_bucket(self, out: SchedulerOutput) -> int | None:
        if not self.use_graphs:
            return None
        items = out.scheduled
        if not all(s.num_tokens == 1 and s.samples for s in items):
            return None
        if any(len(s.request.block_ids) > self.graph_width for s in items):
            return None
        self.capture_graphs()
        return self.graphs.bucket_for(len(items))

    def _swap(self, out: SchedulerOutput) -> None:
        """Block copies the scheduler asked for, before the forward can overwrite freed GPU blocks."""
        swap = self.state.swap
        for gpu_ids, cpu_ids in out.swap_out:
            swap.copy_out(self.state.kv_caches, swap.caches, gpu_ids, cpu_ids)
        for cpu_ids, gpu_ids in out.swap_in:
            swap.copy_in(self.state.kv_caches, swap.caches, cpu_ids, gpu_ids)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (every layer's K and V) before this step writes them."""
        for k, v in self.state.kv_caches:
            src = torch.tensor([c[0] for c in copies], device=k.device)
            dst = torch.tensor([c[1] for c in copies], device=k.device)
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, previous_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, list[Request]]:
        """Launch one step; returns logits ``[num_sampled, vocab]`` and the requests they belong to.

        ``previous_tokens``: the tokens the step before sampled, on the device, in its sampling order; a
        request whose last token the host has not read yet (``Request.num_pending_tokens``) reads it there.
        """
        if not self._warmed:
            self.warmup()
        if out.swap_out or out.swap_in:
            self._swap(out)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        bucket = self._graph_bucket(out)
        if bucket is not None:
            host = build_host_step(out, self.block_size, pad_tokens=bucket)
            self.graphs.load(self._stage(host.packed), bucket, host.width)
            self._fill_pending(self.graphs.input_ids(bucket), host.pending, previous_tokens)
            logits = self.graphs.replay(bucket, host.num_sampled)
            self.num_graph_steps += 1
            return logits, host.sample_requests
        host: HostStep = build_host_step(out, self.block_size)
        buffer = self._stage(host.packed).to(self.device, non_blocking=True)
        at = region_slices(host.num_tokens, host.num_reqs)
        self._fill_pending(buffer[at["input_ids"]], host.pending, previous_tokens)
        step = device_views(
            buffer, host.num_tokens, host.num_reqs, host.width, host.max_seqlen_q, host.max_seqlen_k, host.num_sampled
        )
        keep = None
        if not self.single_device and self.supports_logits_to_keep:
            # Layers on several devices: the model indexes its last hidden states (on whichever device the
            # final norm ran) with logits_to_keep. accelerate's hooks move tensor arguments to the first
            # device, so the indices go as a list of ints, which indexes a tensor on any device.
            keep = host.packed[at["logits_indices"]][: host.num_sampled].tolist()
        self.num_eager_steps += 1
        return self.forward(step, logits_indices=keep), host.sample_requests
