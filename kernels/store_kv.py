"""store_kv: scatter this step's key/value rows into the paged KV cache (one launch for K and V)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import (
    CACHE_DTYPES,
    FLOAT_DTYPES,
    FP8_MAX,
    check_devices,
    check_dim,
    check_kv_scales,
    check_tensor,
    launches_on_first_tensor_gpu,
    next_power_of_2,
    unit_stride,
)
from .dependent_launch import check_launch_pdl, launch_options, wait_for_previous_kernel


@triton.jit
def to_cache(x, scale_ptr, cache_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    # x as the cache stores it: fp8 caches divide by the layer's scale and saturate to the format's finite range
    # (quantize on write); the attention kernel's decode-step store uses this too, so both write the same bits
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / tl.load(scale_ptr), -FP8_MAX), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM]
    value_ptr,  # [T, NUM_KV_HEADS, HEAD_DIM_V]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM_V]
    slot_mapping_ptr,  # [T] int32/int64, -1 = skip
    k_scale_ptr,  # [1] fp32 (read when FP8): cache value = key / k_scale, clamped to +-FP8_MAX
    v_scale_ptr,  # [1] fp32 (read when FP8)
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_k_cache_b,
    stride_k_cache_s,
    stride_k_cache_h,
    stride_k_cache_d,
    stride_v_cache_b,
    stride_v_cache_s,
    stride_v_cache_h,
    stride_v_cache_d,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per token: all heads of its K row and V row, as one [heads, head_dim] tile each.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # a step input: read before the previous kernel ends
    wait_for_previous_kernel(USE_PDL)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    head_mask = offs_h < NUM_KV_HEADS

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(
        key_ptr + token * stride_key_t + offs_h[:, None] * stride_key_h + offs_d[None, :] * stride_key_d,
        mask=mask,
    )
    k_dst = (
        k_cache_ptr
        + block * stride_k_cache_b
        + offset * stride_k_cache_s
        + offs_h[:, None] * stride_k_cache_h
        + offs_d[None, :] * stride_k_cache_d
    )
    tl.store(k_dst, to_cache(k, k_scale_ptr, k_cache_ptr, FP8, FP8_MAX), mask=mask)

    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mask_v = head_mask[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    v = tl.load(
        value_ptr + token * stride_value_t + offs_h[:, None] * stride_value_h + offs_dv[None, :] * stride_value_d,
        mask=mask_v,
    )
    v_dst = (
        v_cache_ptr
        + block * stride_v_cache_b
        + offset * stride_v_cache_s
        + offs_h[:, None] * stride_v_cache_h
        + offs_dv[None, :] * stride_v_cache_d
    )
    tl.store(v_dst, to_cache(v, v_scale_ptr, v_cache_ptr, FP8, FP8_MAX), mask=mask_v)


@launches_on_first_tensor_gpu
def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_warps: int | None = None,
    launch_pdl: bool = False,
) -> None:
    """Write key/value ``[T, num_kv_heads, head_dim]`` into the paged caches at ``slot_mapping`` (-1 = skip).

    fp8 caches (float8_e4m3fn / float8_e5m2) need ``k_scale``/``v_scale`` (one-element float32 tensors): each
    value is stored as ``x / scale`` saturated to the format's finite range. ``launch_pdl``: programmatic
    dependent launch (see ``dependent_launch.py``; needs ``dependent_launch_supported``).
    """
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    check_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    check_devices(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_launch_pdl(launch_pdl, key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    check_dim("value", value, 0, num_tokens, "key.shape[0], the number of tokens")
    check_dim("value", value, 1, num_kv_heads, "key.shape[1], num_kv_heads")
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "key.shape[0], the number of tokens")
    slot_mapping = unit_stride(slot_mapping)
    check_dim("k_cache", k_cache, 2, num_kv_heads, "key.shape[1], num_kv_heads")
    check_dim("k_cache", k_cache, 3, head_dim, "key.shape[2], head_dim")
    check_dim("v_cache", v_cache, 0, num_blocks, "k_cache.shape[0], num_blocks")
    check_dim("v_cache", v_cache, 1, block_size, "k_cache.shape[1], block_size")
    check_dim("v_cache", v_cache, 2, num_kv_heads, "key.shape[1], num_kv_heads")
    check_dim("v_cache", v_cache, 3, value.shape[2], "value.shape[2], head_dim of V")
    if num_tokens == 0:
        return
    head_dim_v = value.shape[2]
    heads_pad = next_power_of_2(num_kv_heads)
    tile = heads_pad * max(next_power_of_2(head_dim), next_power_of_2(head_dim_v))
    if num_warps is None:
        num_warps = min(8, max(1, tile // 256))
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else slot_mapping,  # unused without fp8
        v_scale if fp8 else slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=next_power_of_2(head_dim_v),
        BLOCK_SIZE=block_size,
        FP8=fp8,
        FP8_MAX=FP8_MAX.get(k_cache.dtype, 0.0),
        USE_PDL=launch_pdl,
        num_warps=num_warps,
        **launch_options(launch_pdl),
    )
