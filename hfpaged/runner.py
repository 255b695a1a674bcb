"""Turns a SchedulerOutput into one packed forward of the unmodified model and returns last-token logits."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention import ATTENTION_NAME, AttentionMetadata, ForwardContext, set_forward_context
from .request import Request
from .scheduler import SchedulerOutput

if TYPE_CHECKING:
    from .patch import PatchState


@dataclass
class StepBatch:
    """One packed step: ``input_ids``/``position_ids`` are ``[1, T]``; logits are kept at ``logits_indices``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]


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

    def prepare_inputs(self, out: SchedulerOutput) -> StepBatch:
        """Build the packed batch on the host (numpy) and copy it to the device."""
        items = out.scheduled
        num_reqs = len(items)
        q_lens = np.fromiter((s.num_tokens for s in items), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.start for s in items), dtype=np.int64, count=num_reqs)
        cu_seqlens_q = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_seqlens_q[1:])
        seq_lens = starts + q_lens
        max_blocks = max(len(s.request.block_ids) for s in items)
        block_tables = np.full((num_reqs, max_blocks), -1, dtype=np.int64)
        token_chunks = []
        for i, s in enumerate(items):
            blocks = s.request.block_ids
            block_tables[i, : len(blocks)] = blocks
            token_chunks.append(s.request.all_token_ids[s.start : s.start + s.num_tokens])
        input_ids = np.fromiter((t for chunk in token_chunks for t in chunk), dtype=np.int64, count=int(cu_seqlens_q[-1]))
        # position of every packed token, and the sequence it belongs to
        seq_of_token = np.repeat(np.arange(num_reqs), q_lens)
        positions = np.arange(int(cu_seqlens_q[-1])) - cu_seqlens_q[seq_of_token] + starts[seq_of_token]
        slot_mapping = block_tables[seq_of_token, positions // self.block_size] * self.block_size + positions % self.block_size

        sample_rows = [i for i, s in enumerate(items) if s.samples]
        logits_indices = cu_seqlens_q[1:][sample_rows] - 1

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)).to(device),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(seq_lens.max()),
        )
        return StepBatch(
            input_ids=torch.from_numpy(input_ids).to(device)[None],
            position_ids=torch.from_numpy(positions).to(device)[None],
            metadata=metadata,
            logits_indices=torch.from_numpy(logits_indices).to(device),
            sample_requests=[items[i].request for i in sample_rows],
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """Run one step; returns float32 logits ``[num_sampled, vocab]`` and the requests they belong to."""
        batch = self.prepare_inputs(out)
        context = ForwardContext(
            "paged",
            kv_caches=self.state.kv_caches,
            metadata=batch.metadata,
            store_fn=self.store_fn,
            attention_fn=self.attention_fn,
        )
        kwargs = {}
        if self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = batch.logits_indices
        with paged_mode(self.state, context):
            output = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=False,
                **kwargs,
            )
        logits = output.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, batch.logits_indices.to(logits.device))
        return logits.float(), batch.sample_requests
