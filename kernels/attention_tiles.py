"""The tile loops of the paged-attention kernel: one TILE_N-key step of the online softmax, with keys gathered
through the block table (``_attend_tiles``) or, for prompt chunks, read as boxes of the step's own rows by TMA
(``_attend_step_tiles``). The kernel itself is in attention_kernel.py; the design in paged_attention.py."""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp2, saturating cleanly to +-1 for large |x| (no libdevice dependence).
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    tile,
    q_pos,  # [BLOCK_M] absolute position of each row's query
    kv_end,  # keys at or past this position are never loaded
    k_head_ptr,  # k_cache at this program's KV head
    v_head_ptr,
    block_table_row_ptr,  # [max_blocks] of this sequence
    qk_scale,  # sm_scale * log2(e); with softcap: sm_scale / softcap
    softcap,  # softcap * log2(e)
    window,
    stride_k_b,
    stride_k_s,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_d,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One TILE_N-key step of the online softmax (log2 domain) for all rows of the program.
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    k_pos = tile * TILE_N + offs_n
    if MASKED:
        key_ok = k_pos < kv_end
        block_ids = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
    slot_in_block = k_pos % BLOCK_SIZE
    k_ptrs = (
        k_head_ptr + (block_ids * stride_k_b + slot_in_block * stride_k_s)[None, :] + offs_d[:, None] * stride_k_d
    )  # [HEAD_DIM_PAD, TILE_N]
    v_ptrs = (
        v_head_ptr + (block_ids * stride_v_b + slot_in_block * stride_v_s)[:, None] + offs_dv[None, :] * stride_v_d
    )  # [TILE_N, HEAD_DIM_V_PAD]
    if MASKED:
        k_mask = key_ok[None, :]
        v_mask = key_ok[:, None]
        if HEAD_DIM_PAD != HEAD_DIM:
            k_mask = k_mask & (offs_d < HEAD_DIM)[:, None]
        if HEAD_DIM_V_PAD != HEAD_DIM_V:
            v_mask = v_mask & (offs_dv < HEAD_DIM_V)[None, :]
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    else:
        if HEAD_DIM_PAD != HEAD_DIM:
            k = tl.load(k_ptrs, mask=(offs_d < HEAD_DIM)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if HEAD_DIM_V_PAD != HEAD_DIM_V:
            v = tl.load(v_ptrs, mask=(offs_dv < HEAD_DIM_V)[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs)

    # fp8 caches: dequantize on load (fp8 -> q's dtype is exact; the per-layer scales are folded into
    # qk_scale and the final normalisation, so no full-precision copy of the cache exists anywhere)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    return _online_softmax_step(
        acc, m_i, l_i, q, k, v, k_pos, q_pos, qk_scale, softcap, window, USE_SOFTCAP, USE_WINDOW, MASKED, DOT_PRECISION
    )


@triton.jit
def _online_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,  # [HEAD_DIM_PAD, TILE_N] in q's dtype
    v,  # [TILE_N, HEAD_DIM_V_PAD]
    k_pos,  # [TILE_N] key positions
    q_pos,
    qk_scale,
    softcap,
    window,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] fp32
    if USE_SOFTCAP:
        s = softcap * _tanh(s * qk_scale)  # already scaled, log2 domain
        mult = 1.0
    else:
        mult = qk_scale  # folded into the exponent below (one FMA per score)
    if MASKED:
        allowed = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * mult)
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet keep zero weight
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * mult - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)  # in-place accumulate
    return acc, m_new, l_i


@triton.jit
def _attend_step_tiles(
    acc,
    m_i,
    l_i,
    q,
    tile_begin,
    tile_end,
    row_offset,  # the step row of key position p is row_offset + p (p at or past the sequence's context)
    kv_head,
    k_step_desc,  # TMA descriptors over the step's own keys / values [T, num_kv_heads, D]
    v_step_desc,
    qk_scale,
    softcap,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Unmasked tiles whose keys are in contiguous rows (the step's own, or copied by context_rows.py): whole
    # [TILE_N, D] boxes by TMA instead of per-key gathers through the block table (the cache holds the same values).
    for tile in range(tile_begin, tile_end):
        row = row_offset + tile * TILE_N
        k = k_step_desc.load([row, kv_head, 0]).reshape(TILE_N, HEAD_DIM_PAD).to(q.dtype)  # fp8 rows: as gathered
        v = v_step_desc.load([row, kv_head, 0]).reshape(TILE_N, HEAD_DIM_V_PAD).to(q.dtype)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, tl.trans(k), v, tile, tile, qk_scale, softcap, 0,
            USE_SOFTCAP, False, False, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    tile_begin,
    tile_end,
    q_pos,
    kv_end,
    k_head_ptr,
    v_head_ptr,
    block_table_row_ptr,
    qk_scale,
    softcap,
    window,
    stride_k_b,
    stride_k_s,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_d,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    for tile in range(tile_begin, tile_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tile, q_pos, kv_end, k_head_ptr, v_head_ptr, block_table_row_ptr,
            qk_scale, softcap, window, stride_k_b, stride_k_s, stride_k_d, stride_v_b, stride_v_s, stride_v_d,
            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_SIZE, TILE_N,
            USE_SOFTCAP, USE_WINDOW, MASKED, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i
