"""Torch reference kernels: the same contract as the Triton ``store_kv`` / ``paged_attention``, on any device.

Slot layout (shared by every layer): the KV cache of one layer is a pair of tensors
``[num_blocks, block_size, num_kv_heads, head_dim]``; token position ``p`` of a request lives in
slot ``block_table[p // block_size] * block_size + p % block_size``. A block id names the same
slot range in every layer, so one block table per request serves the whole model.

fp8 caches (float8_e4m3fn / float8_e5m2) hold ``x / scale`` saturated to the format's finite range, with one
float32 scale per layer for K and one for V; reading multiplies back (``dequantize``).

They are what hfpaged runs on the CPU and the yardstick the Triton kernels are tested against.
"""

from __future__ import annotations

import torch

from ._checks import FP8_DTYPES, FP8_MAX, check_kv_scales


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as cache values of ``dtype``: a plain cast, or for fp8 ``x / scale`` clamped to +-max, rounded."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = FP8_MAX[dtype]
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize(
    cache_values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Cache values as ``dtype`` (times ``scale`` for fp8)."""
    if cache_values.dtype not in FP8_DTYPES:
        return cache_values.to(dtype)
    return cache_values.to(dtype) * scale.to(dtype)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    # fp8 as bytes: index_copy_ has no fp8 kernel on the CPU; a block copy moves bytes anyway
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value ``[T, num_kv_heads, head_dim]`` into the caches at ``slot_mapping`` (-1 = skip);
    fp8 caches need ``k_scale``/``v_scale`` (one-element float32 tensors)."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    k_rows = _raw(quantize(key, k_scale, k_cache.dtype))
    v_rows = _raw(quantize(value, v_scale, v_cache.dtype))
    _raw(k_cache).view(-1, *k_rows.shape[1:]).index_copy_(0, slots, k_rows)
    _raw(v_cache).view(-1, *v_rows.shape[1:]).index_copy_(0, slots, v_rows)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference paged attention over a packed batch (causal, GQA, sliding window, softcap, attention sinks; fp8
    caches are dequantized with ``k_scale``/``v_scale``).

    q is ``[T, num_heads, head_dim]``; the ``q_len`` queries of sequence ``b`` are its last
    ``q_len`` positions out of ``seq_lens[b]``. Scores are computed in float32 (float64 for float64 q).
    ``max_seqlen_q``/``max_seqlen_k`` are optional host-side hints (unused here; kernels size grids by them), and so
    are ``key``/``value`` (the step's own keys: the reference reads every key from the cache). ``slot_mapping``: store
    ``key``/``value`` into the caches at these slots first (``store_kv_reference``). ``sinks`` ``[num_heads]``: one
    logit per head that joins each row's softmax (after the scale and softcap) with no value; its share is dropped.
    """
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if slot_mapping is not None:
        if key is None or value is None:
            raise ValueError("slot_mapping stores the step's keys and values: give key and value too")
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    num_tokens, num_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    head_dim_v = v_cache.shape[-1]
    group = num_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
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
        qg = q[q_start:q_end].reshape(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3).to(compute)
        scores = torch.matmul(qg, dequantize(k, k_scale, compute).permute(1, 2, 0).unsqueeze(1)) * scale
        if softcap is not None and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None and sliding_window > 0:
            allowed &= (q_pos - k_pos) < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.to(compute).reshape(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, dequantize(v, v_scale, compute).permute(1, 0, 2).unsqueeze(1))  # [kv, group, q_len, dv]
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim_v).to(q.dtype)
    return out
