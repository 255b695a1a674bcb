"""Torch reference kernels: the same contract as the Triton ``store_kv`` / ``paged_attention``, on any device.

Slot layout (shared by every layer): the KV cache of one layer is a pair of tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of a request lives in
slot ``block_table[p // block_size] * block_size + p % block_size``. A block id names the same
slot range in every layer, so one block table per request serves the whole model.

They are what hfpaged runs on the CPU and the yardstick the Triton kernels are tested against.
"""

from __future__ import annotations

import torch


def store_kv_reference(
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


def paged_attention_reference(
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
        num_seq_blocks = (seq_len + block_size - 1) // block_size
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
