"""Paged attention: the torch reference kernels and the attention function registered with transformers.

Slot layout (shared by every layer): the KV cache of one layer is a pair of tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of a request lives in
slot ``block_table[p // block_size] * block_size + p % block_size``. A block id names the same
slot range in every layer, so one block table per request serves the whole model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

ATTENTION_NAME = "hfpaged"


class UnsupportedModelError(TypeError):
    """The model's attention cannot be paged by hfpaged."""


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value ``[T, num_kv_heads, head_dim]`` into the caches at ``slot_mapping`` (-1 = skip)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Reference paged attention over a packed batch (causal, GQA, sliding window, softcap).

    q is ``[T, num_heads, head_dim]``; the ``q_len`` queries of sequence ``b`` are its last
    ``q_len`` positions out of ``seq_lens[b]``. Scores are computed in float32.
    ``max_seqlen_q``/``max_seqlen_k`` are optional host-side hints (unused here; kernels size grids by them).
    """
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    head_dim_v = v_cache.shape[-1]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    seq_lens_list = seq_lens.tolist()
    cu_list = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens_list):
        q_start, q_end = cu_list[b], cu_list[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_seq_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :num_seq_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[-1])[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim_v)[:seq_len]
        qg = q[q_start:q_end].reshape(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3).float()
        scores = torch.matmul(qg, k.permute(1, 2, 0).float().unsqueeze(1)) * scale
        if softcap is not None and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.permute(1, 0, 2).float().unsqueeze(1))  # [kv, group, q_len, dv]
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim_v).to(q.dtype)
    return out


@dataclass
class AttentionMetadata:
    """Per-step tensors every layer reads (all on one device)."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    _by_device: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> "AttentionMetadata":
        """This metadata on ``device`` (layers spread over several devices each read their own copy)."""
        if self.slot_mapping.device == device:
            return self
        cached = self._by_device.get(device)
        if cached is None:
            cached = AttentionMetadata(
                self.slot_mapping.to(device),
                self.block_tables.to(device),
                self.seq_lens.to(device),
                self.cu_seqlens_q.to(device),
                self.max_seqlen_q,
                self.max_seqlen_k,
            )
            self._by_device[device] = cached
        return cached


@dataclass
class LayerRecord:
    """What discovery learned about one attention module."""

    module: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None
    softcap: float | None


class ForwardContext:
    """State the registered attention function reads while an hfpaged forward runs.

    ``mode="discover"`` records each attention module as it is called (patch time);
    ``mode="paged"`` stores this step's K/V into each layer's own caches (``module._hfpaged_kv``,
    bound by ``patch``) and attends over the block tables.
    """

    def __init__(
        self,
        mode: str,
        metadata: AttentionMetadata | None = None,
        store_fn: Callable[..., None] | None = None,
        attention_fn: Callable[..., torch.Tensor] | None = None,
    ):
        self.mode = mode
        self.metadata = metadata
        self.store_fn = store_fn
        self.attention_fn = attention_fn
        self.records: list[LayerRecord] = []


_context: ForwardContext | None = None


def set_forward_context(context: ForwardContext | None) -> ForwardContext | None:
    """Install ``context`` for the attention function; returns the previous one."""
    global _context
    previous, _context = _context, context
    return previous


def get_forward_context() -> ForwardContext | None:
    return _context


def _discover(context: ForwardContext, module, query, key, value, sliding_window, softcap):
    if getattr(module, "_hfpaged_discovered", False):
        raise UnsupportedModelError(
            f"attention module {type(module).__name__} ran twice in one forward; "
            "hfpaged needs one KV cache per attention call"
        )
    module._hfpaged_discovered = True
    context.records.append(
        LayerRecord(
            module=module,
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=key.shape[-1],
            head_dim_v=value.shape[-1],
            dtype=key.dtype,
            device=key.device,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    )
    batch, num_heads, seq_len, _ = query.shape
    return query.new_zeros(batch, seq_len, num_heads, value.shape[-1])


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: q/k/v ``[1, heads, T, D]`` packed -> ``[1, T, heads, D]``."""
    if "hfpaged_block_tables" in kwargs:  # compiled decode: the metadata came as forward kwargs
        from .compiled import compiled_attention

        if scaling is None:
            scaling = 1.0 / math.sqrt(query.shape[-1])
        return compiled_attention(module, query, key, value, scaling, sliding_window, softcap, kwargs), None
    context = _context
    if context is None:
        raise RuntimeError(
            "the hfpaged attention implementation was called outside an hfpaged forward; "
            "call model(...) normally - patch() only switches attention during generate_many steps"
        )
    if context.mode == "discover":
        return _discover(context, module, query, key, value, sliding_window, softcap), None
    if query.shape[0] != 1:
        raise ValueError(f"hfpaged expects a packed batch of shape [1, T], got batch size {query.shape[0]}")
    k_cache, v_cache = module._hfpaged_kv
    meta = context.metadata.on(query.device)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    context.store_fn(k, v, k_cache, v_cache, meta.slot_mapping)
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    out = context.attention_fn(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
    )
    return out.unsqueeze(0), None
