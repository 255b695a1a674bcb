"""context_rows: the cached context of long prompt chunks, copied out of the paged cache into contiguous rows.

A prompt chunk that follows a cached context (the second chunk of a long prompt, a prompt after a prefix-cache
hit) reads that context in every query block of every KV head. Through the block table each of those reads is a
per-key gather; ``paged_attention`` instead has this kernel copy the whole-tile part of each such context once per
call into a scratch ``[rows, num_kv_heads, D]`` (bitwise the cache's values), which the attention kernel then reads
by TMA boxes like the step's own rows (notes/kernels.md, session 16). fp8 caches, whose step rows are not the
cache's (quantized) values, copy every whole tile of the sequence instead, the step's just stored keys included,
converted once to the dtype the attention tiles would convert them to (so the tile loop converts nothing).

Which sequences get rows is decided on the device from the step's metadata only (CUDA-graph safe): a sequence
whose chunk has at least ``min_q`` query tokens gets ``context // TILE_N * TILE_N`` rows at the running offset, as
long as they fit the scratch's capacity (later sequences then get none). ``offsets[b]`` is that first row, or -1:
the attention kernel gathers the context of those sequences as before.

Also here: when the step's own rows (``step_kv_usable``) and copied rows (``context_rows_usable``, in the dtype
``context_rows_dtype``) can be read by TMA at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import FP8_DTYPES, next_power_of_2
from .dependent_launch import launch_options, wait_for_previous_kernel


@triton.jit
def _context_rows_kernel(
    k_rows_ptr,  # [capacity, NUM_KV_HEADS, HEAD_DIM] out
    v_rows_ptr,  # [capacity, NUM_KV_HEADS, HEAD_DIM_V] out
    offsets_ptr,  # [num_seqs] int32 out: first row of each sequence's context, -1 = none
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    num_seqs,
    capacity,  # rows of the scratch (a multiple of TILE_N)
    min_q,  # chunks of fewer query tokens get no rows
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt_b,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    WHOLE_SEQUENCE: tl.constexpr,  # rows for every key of the sequence (fp8 caches), not only its cached context
    USE_PDL: tl.constexpr,
):
    # Program (p, kv_head) copies scratch rows [p * TILE_N, (p + 1) * TILE_N) of one KV head; every sequence's rows
    # are a whole number of tiles, so they belong to one sequence. The assignment reads step inputs only.
    row0 = tl.program_id(0) * TILE_N
    kv_head = tl.program_id(1)
    found = 0
    my_seq = 0
    my_first = 0
    carry = 0
    for chunk in range(0, tl.cdiv(num_seqs, SEARCH_BLOCK)):
        b, first, ok, end, carry = _chunk_rows(
            cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, capacity, min_q, chunk, carry,
            TILE_N, SEARCH_BLOCK, WHOLE_SEQUENCE,
        )  # fmt: skip
        hit = ok & (first <= row0) & (row0 < end)
        found += tl.sum(hit.to(tl.int32), 0)
        my_seq += tl.sum(tl.where(hit, b, 0), 0)
        my_first += tl.sum(tl.where(hit, first, 0), 0)
    # the offsets buffer and the rows may reuse memory an earlier kernel of the step still reads: write after the wait
    wait_for_previous_kernel(USE_PDL)
    if (tl.program_id(0) == 0) & (kv_head == 0):
        carry = 0
        for chunk in range(0, tl.cdiv(num_seqs, SEARCH_BLOCK)):
            b, first, ok, end, carry = _chunk_rows(
                cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, capacity, min_q, chunk, carry,
                TILE_N, SEARCH_BLOCK, WHOLE_SEQUENCE,
            )  # fmt: skip
            tl.store(offsets_ptr + b, tl.where(ok, first, -1), mask=b < num_seqs)
    if found == 0:
        return
    pos = row0 - my_first + tl.arange(0, TILE_N)  # key positions of this sequence, all inside its context
    block_ids = tl.load(block_tables_ptr + my_seq.to(tl.int64) * stride_bt_b + pos // BLOCK_SIZE).to(tl.int64)
    slot = pos % BLOCK_SIZE
    rows_out = (row0 + tl.arange(0, TILE_N)).to(tl.int64) * NUM_KV_HEADS + kv_head
    offs_d = tl.arange(0, HEAD_DIM)
    k_src = k_cache_ptr + (block_ids * stride_k_b + slot * stride_k_s + kv_head * stride_k_h)[:, None]
    k = tl.load(k_src + offs_d[None, :] * stride_k_d)
    tl.store(k_rows_ptr + (rows_out * HEAD_DIM)[:, None] + offs_d[None, :], k.to(k_rows_ptr.dtype.element_ty))
    offs_dv = tl.arange(0, HEAD_DIM_V)
    v_src = v_cache_ptr + (block_ids * stride_v_b + slot * stride_v_s + kv_head * stride_v_h)[:, None]
    v = tl.load(v_src + offs_dv[None, :] * stride_v_d)
    tl.store(v_rows_ptr + (rows_out * HEAD_DIM_V)[:, None] + offs_dv[None, :], v.to(v_rows_ptr.dtype.element_ty))


@triton.jit
def _chunk_rows(cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, capacity, min_q, chunk, carry, TILE_N: tl.constexpr,
                SEARCH_BLOCK: tl.constexpr, WHOLE_SEQUENCE: tl.constexpr):  # fmt: skip
    # Sequences [chunk * SEARCH_BLOCK, ...): (ids, first row, has rows, end row, rows before the next chunk).
    b = chunk * SEARCH_BLOCK + tl.arange(0, SEARCH_BLOCK)
    real = b < num_seqs
    q_len = tl.load(cu_seqlens_q_ptr + b + 1, mask=real, other=0) - tl.load(cu_seqlens_q_ptr + b, mask=real, other=0)
    keys = tl.load(seq_lens_ptr + b, mask=real, other=0)
    if not WHOLE_SEQUENCE:
        keys -= q_len  # the cached context only
    rows = tl.where(real & (q_len >= min_q), keys // TILE_N * TILE_N, 0)
    end = tl.cumsum(rows, 0) + carry
    first = end - rows
    ok = (rows > 0) & (end <= capacity)
    return b, first, ok, end, carry + tl.sum(rows, 0)


def context_capacity(num_tokens: int, max_seqlen_k: int, k_cache: torch.Tensor, v_cache: torch.Tensor, tile_n: int,
                     max_bytes: int, rows_dtype: torch.dtype) -> int:  # fmt: skip
    """Rows of the context scratch (in ``rows_dtype``) for a step of ``num_tokens`` tokens over sequences of up to
    ``max_seqlen_k`` keys: the longest sequence plus twice the step's tokens (so a short chunk after a long cached
    prefix gets its rows too), at most ``max_bytes`` of K and V rows, a multiple of ``tile_n`` (0: no whole tile)."""
    row_bytes = k_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * rows_dtype.itemsize
    return min(max_seqlen_k + 2 * num_tokens, max_bytes // row_bytes) // tile_n * tile_n


def copy_context_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    capacity: int,
    tile_n: int,
    min_q: int,
    search_block: int,
    whole_sequence: bool = False,
    rows_dtype: torch.dtype | None = None,
    launch_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (k_rows, v_rows, offsets): the whole-tile part of the cached context (``whole_sequence``: of all the keys,
    the step's just stored included) of every chunk of at least ``min_q`` query tokens, as contiguous rows
    ``[capacity, num_kv_heads, D]`` (sequence b's key position p at row ``offsets[b] + p``; ``offsets[b] == -1``: no
    rows), converted to ``rows_dtype`` (default: the cache's; fp8 caches convert exactly to 16- or 32-bit floats).
    Arguments as ``paged_attention`` checked them; power-of-two heads."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    head_dim_v = v_cache.shape[3]
    if head_dim != next_power_of_2(head_dim) or head_dim_v != next_power_of_2(head_dim_v):
        raise ValueError(f"context rows need power-of-two heads, got {head_dim} and {head_dim_v}")
    if capacity <= 0 or capacity % tile_n:
        raise ValueError(f"capacity must be a positive multiple of tile_n={tile_n}, got {capacity}")
    num_seqs = seq_lens.shape[0]
    device = k_cache.device
    k_rows = torch.empty(capacity, num_kv_heads, head_dim, dtype=rows_dtype or k_cache.dtype, device=device)
    v_rows = torch.empty(capacity, num_kv_heads, head_dim_v, dtype=rows_dtype or v_cache.dtype, device=device)
    offsets = torch.empty(num_seqs, dtype=torch.int32, device=device)
    _context_rows_kernel[(capacity // tile_n, num_kv_heads)](
        k_rows,
        v_rows,
        offsets,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        num_seqs,
        capacity,
        min_q,
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        SEARCH_BLOCK=search_block,
        WHOLE_SEQUENCE=whole_sequence,
        USE_PDL=launch_pdl,
        num_warps=4,
        **launch_options(launch_pdl),
    )
    return k_rows, v_rows, offsets


def step_kv_usable(q, k_cache, v_cache, key, value) -> bool:
    """Whether the step's own keys/values (checked: ``[T, num_kv_heads, D]`` like q and the caches) can feed the TMA
    tiles: 16-bit caches (fp8 caches hold quantized values, which the kernel must read), power-of-two heads of at
    most 128 (one TMA box row), K and V heads alike, rows TMA can address (16-byte aligned base and strides, unit
    stride along a head)."""
    for name, t, cache in (("key", key, k_cache), ("value", value, v_cache)):
        expected = (q.shape[0], cache.shape[2], cache.shape[3])
        if tuple(t.shape) != expected or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be [{expected[0]}, {expected[1]}, {expected[2]}] {q.dtype} on {q.device} "
                f"(q's tokens, the cache's KV heads and head dim), got {list(t.shape)} {t.dtype} on {t.device}"
            )
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    if not _tma_heads(k_cache, v_cache):
        return False
    for t in (key, value):
        size = t.element_size()
        if t.stride(2) != 1 or t.data_ptr() % 16 or (t.stride(0) * size) % 16 or (t.stride(1) * size) % 16:
            return False
    return True


def _tma_heads(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """K and V heads of one power-of-two width of at most 128 (one TMA box row)."""
    head_dim = k_cache.shape[3]
    return v_cache.shape[3] == head_dim and head_dim <= 128 and head_dim == next_power_of_2(max(16, head_dim))


def context_rows_usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the cache can be copied into rows the kernel reads by TMA (context_rows.py): 16-bit caches of q's dtype
    or fp8 caches (rows of the whole sequence then), heads as ``_tma_heads``."""
    fp8 = k_cache.dtype in FP8_DTYPES and v_cache.dtype == k_cache.dtype
    same = q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
    return (fp8 or same) and _tma_heads(k_cache, v_cache)


def context_rows_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the copied rows: the cache's for 16-bit caches; for fp8 caches the one the attention tiles convert
    K/V to (fp16 for 16-bit queries, whose dots then run in fp16; q's dtype otherwise)."""
    if cache_dtype not in FP8_DTYPES:
        return cache_dtype
    return torch.float16 if q_dtype in (torch.float16, torch.bfloat16) else q_dtype
