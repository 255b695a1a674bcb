"""The paged-attention Triton kernel (see paged_attention.py for the wrapper and the design)."""

import triton
import triton.language as tl

from .attention_tiles import _attend_step_tiles, _attend_tiles
from .dependent_launch import wait_for_previous_kernel
from .store_kv import to_cache


@triton.jit
def _locate_sequence(
    cu_seqlens_q_ptr, seq_lens_ptr, program, num_seqs, BLOCK_Q: tl.constexpr, SEARCH_BLOCK: tl.constexpr
):
    # -> (seq, q_start, q_end, seq_len) of the sequence owning this program. Sequence b's first
    # program id is cu[b] // BLOCK_Q + b (cu[b] when BLOCK_Q == 1); these never decrease, so seq =
    # (number of first ids <= program) - 1. With num_seqs + 1 <= SEARCH_BLOCK, one round trip of
    # vector load of cu and three scalar loads answer everything; otherwise count chunk by chunk.
    if num_seqs + 1 <= SEARCH_BLOCK:
        b = tl.arange(0, SEARCH_BLOCK)
        cu = tl.load(cu_seqlens_q_ptr + b, mask=b <= num_seqs, other=1 << 30)
        if BLOCK_Q > 1:
            first = cu // BLOCK_Q + b
        else:
            first = cu
        seq = tl.sum((first <= program).to(tl.int32), 0) - 1
        # the three values by address (cu's line is in L1 from the vector load): one cross-warp reduction, not four
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
    else:
        count = 0
        for chunk in range(0, tl.cdiv(num_seqs, SEARCH_BLOCK)):
            b = chunk * SEARCH_BLOCK + tl.arange(0, SEARCH_BLOCK)
            first = tl.load(cu_seqlens_q_ptr + b, mask=b < num_seqs, other=1 << 30)
            if BLOCK_Q > 1:
                first = first // BLOCK_Q + b
            count += tl.sum((first <= program).to(tl.int32), 0)
        seq = count - 1
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, q_end, seq_len


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_split_tiles", "split_target_programs", "window"])
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, HEAD_DIM_V] (written when SPLIT is False)
    split_acc_ptr,  # [T, num_heads, num_splits, HEAD_DIM_V_PAD] fp32 (written when SPLIT)
    split_max_ptr,  # [T, num_heads, num_splits] fp32, log2 domain
    split_sum_ptr,  # [T, num_heads, num_splits] fp32
    q_ptr,  # [T, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM_V]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    k_scale_ptr,  # [1] fp32, read when KV_FP8: key = cache value * k_scale
    v_scale_ptr,  # [1] fp32, read when KV_FP8
    sinks_ptr,  # [NUM_HEADS] float, read when USE_SINKS: one logit per query head with no value (attention sinks)
    k_step_desc,  # STEP_KV: TMA descriptors over the step's own keys / values [T, num_kv_heads, D] (else None)
    v_step_desc,
    k_ctx_desc,  # CTX_KV: TMA descriptors over the context rows [rows, num_kv_heads, D] (context_rows.py)
    v_ctx_desc,
    ctx_offsets_ptr,  # CTX_KV: [B] int32, sequence b's key position p at context row offsets[b] + p; -1 = none
    store_key_ptr,  # STORE_KV: the step's keys / values [T, num_kv_heads, D] and their slots [T] (-1 = none)
    store_value_ptr,
    slot_mapping_ptr,
    num_seqs,
    num_splits,
    min_split_tiles,  # SPLIT: a split covers at least this many tiles (short contexts use fewer splits)
    split_target_programs,  # SPLIT, > 0: size splits so the batch's keys make about this many programs
    qk_scale,
    softcap,
    window,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt_b,
    stride_out_t,
    stride_out_h,
    stride_sk_t,
    stride_sk_h,
    stride_sk_d,
    stride_sv_t,
    stride_sv_h,
    stride_sv_d,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
    STEP_KV: tl.constexpr = False,  # unmasked tiles of keys computed in this step load from the step's rows
    CTX_KV: tl.constexpr = False,  # unmasked whole tiles of cached context (fp8: of all keys) load from copied rows
    FP8_DOT_F16: tl.constexpr = True,  # fp8 caches with bf16 queries: dots in fp16 (False: upcast K/V to bf16)
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (dependent_launch.py)
    ONE_QUERY: tl.constexpr = False,  # one query token per sequence; program i is sequence i (AttentionConfig.one_query)
    STORE_KV: tl.constexpr = False,  # one query token per sequence: write its K/V row into the caches first
    FP8_MAX: tl.constexpr = 0.0,  # STORE_KV into fp8 caches: the format's largest finite value
    USE_SINKS: tl.constexpr = False,  # add each head's sink to the softmax's denominator (SPLIT: the merge adds it)
    # the leading one-token rows (sequence b with cu_seqlens_q[b] = b, cu_seqlens_q[b + 1] = b + 1: decode rows ahead
    # of a mixed step's prompt chunks) as a launch of their own: 0 = every sequence; 1 (ONE_QUERY) = only those; 2 =
    # all but those
    LEADING_ROWS: tl.constexpr = 0,
    SKIP_FRESH: tl.constexpr = False,  # sequences with no cached context are left alone (prompt_gluon.py does them)
):
    if ONE_QUERY:
        program = tl.program_id(0)
        kv_head = tl.program_id(1)
    else:
        # Query launches have a flat grid with the KV heads innermost: the GPU starts programs in grid order, so the
        # heaviest causal blocks of every head start first (heads outermost started the last head's heavy blocks
        # after the other heads' light ones: a tail of a few long programs on a single long prompt)
        program = tl.program_id(0) // (NUM_HEADS // GROUP)
        kv_head = tl.program_id(0) % (NUM_HEADS // GROUP)
    split = tl.program_id(2)

    # the sequence lookup and the key range read step inputs and host integers only: they may overlap the previous
    # kernel; q and the caches are read, and anything written, after the wait
    if ONE_QUERY:  # every sequence has one query token (the caller guarantees it): program i is sequence i
        seq = program
        q_start = program
        q_end = program + 1
        if LEADING_ROWS == 1:  # noqa: SIM102 (a compile-time condition apart from the run-time one, for Triton)
            if (tl.load(cu_seqlens_q_ptr + program) != program) | (tl.load(cu_seqlens_q_ptr + program + 1) != q_end):
                # waits too: with no leading row no program of this launch would, and the next kernel's wait would
                # then not cover the one before this (dependent_launch.py)
                wait_for_previous_kernel(USE_PDL)
                return
        seq_len = tl.load(seq_lens_ptr + program)
    else:
        seq, q_start, q_end, seq_len = _locate_sequence(
            cu_seqlens_q_ptr, seq_lens_ptr, program, num_seqs, BLOCK_Q, SEARCH_BLOCK
        )
        if LEADING_ROWS == 2:  # noqa: SIM102
            if (q_start == seq) & (q_end == seq + 1):
                wait_for_previous_kernel(USE_PDL)  # every row may be a leading one (as above)
                return
        if SKIP_FRESH:  # noqa: SIM102
            if seq_len == q_end - q_start:
                wait_for_previous_kernel(USE_PDL)
                return
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + q_start).to(tl.int64)  # a step input too
    q_len = q_end - q_start
    if ONE_QUERY:
        q_block = 0
    elif BLOCK_Q > 1:
        # Last query block first: the heaviest causal blocks start early, the light ones fill the tail.
        num_q_blocks = tl.cdiv(q_len, BLOCK_Q)
        q_block = num_q_blocks - 1 - (program - (q_start // BLOCK_Q + seq))
        if q_block < 0:
            return
    else:
        q_block = program - q_start
    context_len = seq_len - q_len

    # Rows: BLOCK_Q query positions x GROUP heads (padding rows past BLOCK_Q * GROUP or q_len).
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = context_len + q_local
    token = (q_start + q_local).to(tl.int64)

    # Key range of this program: [kv_begin, kv_end); tiles in [full_begin, full_end) need no mask.
    q_first = context_len + q_block * BLOCK_Q
    q_last = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = q_last + 1
    if USE_WINDOW:
        kv_begin = tl.maximum(q_first - window + 1, 0)
        full_begin = tl.maximum(q_last - window + 1, 0)
    else:
        kv_begin = 0
        full_begin = 0
    tile_begin = kv_begin // TILE_N
    tile_end = tl.cdiv(kv_end, TILE_N)
    last_tile_end = tile_end
    if SPLIT:
        # at least min_split_tiles per split: a context too short for num_splits of them leaves the last splits
        # empty (the grid is fixed by host integers; the context length is only known here)
        tiles_per_split = tl.maximum(tl.cdiv(tile_end - tile_begin, num_splits), min_split_tiles)
        if split_target_programs > 0:
            # equal-sized splits across the batch: the keys of all sequences (x KV heads) over the target number
            # of programs, so long and short sequences alike finish together (no long tail of a few programs)
            total_keys = 0
            for chunk in range(0, tl.cdiv(num_seqs, SEARCH_BLOCK)):
                b = chunk * SEARCH_BLOCK + tl.arange(0, SEARCH_BLOCK)
                total_keys += tl.sum(tl.load(seq_lens_ptr + b, mask=b < num_seqs, other=0), 0)
            keys_per_split = tl.cdiv(total_keys * (NUM_HEADS // GROUP), split_target_programs)
            tiles_per_split = tl.maximum(tiles_per_split, tl.cdiv(keys_per_split, TILE_N))
        tile_begin = tile_begin + split * tiles_per_split
        tile_end = tl.minimum(tile_end, tile_begin + tiles_per_split)
        if tile_begin >= tile_end:
            # an empty split: its partial is "no keys" (the merge gives it weight 0 and skips its accumulator)
            wait_for_previous_kernel(USE_PDL)  # the workspace may still be another buffer of the previous kernel
            row = (token * NUM_HEADS + head) * num_splits + split
            tl.store(split_max_ptr + row, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(split_sum_ptr + row, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return
    wait_for_previous_kernel(USE_PDL)
    if STORE_KV:  # noqa: SIM102 (a compile-time condition apart from the run-time one, for Triton)
        # Each sequence has one query token, the last key: the one program of its KV head whose keys include it
        # (the last non-empty split) writes the step's K/V row there, then synchronises its threads, so that its
        # tile loop below reads the row back from the cache (no other program reads that key).
        if tile_end == last_tile_end:
            _store_row(
                store_key_ptr, store_value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot,
                q_start.to(tl.int64), kv_head, stride_sk_t, stride_sk_h, stride_sk_d, stride_sv_t, stride_sv_h,
                stride_sv_d, stride_k_b, stride_k_s, stride_k_h, stride_k_d, stride_v_b, stride_v_s, stride_v_h,
                stride_v_d, HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_SIZE, KV_FP8, FP8_MAX,
            )  # fmt: skip
            tl.debug_barrier()
    full_tile_begin = tl.maximum(tl.minimum(tl.cdiv(full_begin, TILE_N), tile_end), tile_begin)
    full_tile_end = tl.maximum(tl.minimum((q_first + 1) // TILE_N, tile_end), full_tile_begin)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = row_ok[:, None]
    if HEAD_DIM_PAD != HEAD_DIM:
        q_mask = q_mask & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=q_mask,
        other=0.0,
    )

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # q . (k8 * k_scale) = (q . k8) * k_scale
        if FP8_DOT_F16:  # noqa: SIM102 (two compile-time conditions; kept apart for Triton)
            if q_ptr.dtype.element_ty == tl.bfloat16:
                # fp8 -> fp16 is exact and costs one conversion per two values; fp8 -> bf16 goes through fp16
                # and costs three (the conversion pipe, not HBM, then bounds the loop). So both dots run in
                # fp16: q is scaled into fp16's range once per program by a power of two (largest |q| ->
                # [2^13, 2^14)), so every bf16 element is exact in fp16 (3 more mantissa bits; only elements
                # 2^-27 below the largest underflow), the factor folded into qk_scale; P (in [0, 1]) is cast
                # to fp16 for PV. (A non-power-of-two factor rounded q: ~1% weight errors on peaked softmaxes.)
                q32 = q.to(tl.float32)
                q_abs = tl.abs(q32)  # the largest finite |q|: an inf/NaN element stays in its own row
                q_max = tl.max(tl.max(tl.where(q_abs < float("inf"), q_abs, 0.0), 1), 0)
                q_exp = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent of q_max
                mult_exp = tl.minimum(tl.maximum(267 - q_exp, 1), 254)  # 2^(13 - (q_exp - 127)), a normal float
                q_mult = tl.where(q_max > 1e-30, (mult_exp << 23).to(tl.float32, bitcast=True), 1.0)
                q = (q32 * q_mult).to(tl.float16)
                qk_scale = qk_scale / q_mult
    k_head_ptr = k_cache_ptr + kv_head * stride_k_h
    v_head_ptr = v_cache_ptr + kv_head * stride_v_h
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_b

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_WINDOW:  # without a window nothing below the causal range is masked: [tile_begin, full_tile_begin) is empty
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, tile_begin, full_tile_begin, q_pos, kv_end, k_head_ptr, v_head_ptr,
            block_table_row_ptr, qk_scale, softcap, window,
            stride_k_b, stride_k_s, stride_k_d, stride_v_b, stride_v_s, stride_v_d,
            HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_SIZE, TILE_N,
            USE_SOFTCAP, USE_WINDOW, True, DOT_PRECISION,
        )  # fmt: skip
    if STEP_KV:
        # the interior tiles from the first one wholly past the cached context read the step's own rows
        step_tile_begin = tl.minimum(tl.maximum(tl.cdiv(context_len, TILE_N), full_tile_begin), full_tile_end)
    else:
        step_tile_begin = full_tile_end
    gather_begin = full_tile_begin
    if CTX_KV:
        # the interior tiles wholly inside the cached context read the copied context rows (if this sequence has)
        ctx_offset = tl.load(ctx_offsets_ptr + seq)
        if KV_FP8:
            rows_end = seq_len // TILE_N  # fp8 caches: rows for the whole sequence (no step rows)
        else:
            rows_end = context_len // TILE_N
        if ctx_offset >= 0:
            gather_begin = tl.minimum(tl.maximum(rows_end, full_tile_begin), step_tile_begin)
        acc, m_i, l_i = _attend_step_tiles(
            acc, m_i, l_i, q, full_tile_begin, gather_begin, ctx_offset, kv_head, k_ctx_desc,
            v_ctx_desc, qk_scale, softcap, HEAD_DIM_PAD, HEAD_DIM_V_PAD, TILE_N, USE_SOFTCAP, DOT_PRECISION,
        )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, gather_begin, step_tile_begin, q_pos, kv_end, k_head_ptr, v_head_ptr,
        block_table_row_ptr, qk_scale, softcap, window,
        stride_k_b, stride_k_s, stride_k_d, stride_v_b, stride_v_s, stride_v_d,
        HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_SIZE, TILE_N,
        USE_SOFTCAP, USE_WINDOW, False, DOT_PRECISION,
    )  # fmt: skip
    if STEP_KV:
        acc, m_i, l_i = _attend_step_tiles(
            acc, m_i, l_i, q, step_tile_begin, full_tile_end, q_start - context_len, kv_head, k_step_desc,
            v_step_desc, qk_scale, softcap, HEAD_DIM_PAD, HEAD_DIM_V_PAD, TILE_N, USE_SOFTCAP, DOT_PRECISION,
        )  # fmt: skip
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, full_tile_end, tile_end, q_pos, kv_end, k_head_ptr, v_head_ptr,
        block_table_row_ptr, qk_scale, softcap, window,
        stride_k_b, stride_k_s, stride_k_d, stride_v_b, stride_v_s, stride_v_d,
        HEAD_DIM, HEAD_DIM_PAD, HEAD_DIM_V, HEAD_DIM_V_PAD, BLOCK_SIZE, TILE_N,
        USE_SOFTCAP, USE_WINDOW, True, DOT_PRECISION,
    )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)  # sum p * (v8 * v_scale): the partial sums l_i are unaffected
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    if SPLIT:
        row = (token * NUM_HEADS + head) * num_splits + split  # [BLOCK_M] int64
        tl.store(split_acc_ptr + row[:, None] * HEAD_DIM_V_PAD + offs_dv[None, :], acc, mask=row_ok[:, None])
        tl.store(split_max_ptr + row, m_i, mask=row_ok)
        tl.store(split_sum_ptr + row, l_i, mask=row_ok)
    else:
        if USE_SINKS:
            l_i = l_i + _sink_weight(sinks_ptr, head, row_ok, m_i)
        _store_rows(out_ptr, acc, l_i, token, head, row_ok, stride_out_t, stride_out_h, HEAD_DIM_V, HEAD_DIM_V_PAD)


@triton.jit
def _sink_weight(sinks_ptr, head, ok, m):
    # exp2(sink - m) in the kernel's log2 domain: the sink's share of a softmax denominator whose keys were summed
    # relative to m. With m = -inf (no key) it is inf, so the row is 0 as in the reference (only the sink, value 0);
    # a -inf sink (and masked rows) adds 0.
    sink = tl.load(sinks_ptr + head, mask=ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
    return tl.exp2(sink - tl.maximum(m, -3.0e38))


@triton.jit
def _store_row(store_key_ptr, store_value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot, token,
               kv_head, stride_sk_t, stride_sk_h, stride_sk_d, stride_sv_t, stride_sv_h, stride_sv_d, stride_k_b,
               stride_k_s, stride_k_h, stride_k_d, stride_v_b, stride_v_s, stride_v_h, stride_v_d,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               HEAD_DIM_V_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
               FP8_MAX: tl.constexpr):  # fmt: skip
    # One token's K and V rows of one KV head into the caches at slot (< 0: none), as store_kv writes them.
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        k = tl.load(store_key_ptr + token * stride_sk_t + kv_head * stride_sk_h + offs_d * stride_sk_d,
                    mask=offs_d < HEAD_DIM)  # fmt: skip
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        v = tl.load(store_value_ptr + token * stride_sv_t + kv_head * stride_sv_h + offs_dv * stride_sv_d,
                    mask=offs_dv < HEAD_DIM_V)  # fmt: skip
        k_dst = k_cache_ptr + block * stride_k_b + offset * stride_k_s + kv_head * stride_k_h + offs_d * stride_k_d
        tl.store(k_dst, to_cache(k, k_scale_ptr, k_cache_ptr, KV_FP8, FP8_MAX), mask=offs_d < HEAD_DIM)
        v_dst = v_cache_ptr + block * stride_v_b + offset * stride_v_s + kv_head * stride_v_h + offs_dv * stride_v_d
        tl.store(v_dst, to_cache(v, v_scale_ptr, v_cache_ptr, KV_FP8, FP8_MAX), mask=offs_dv < HEAD_DIM_V)


@triton.jit
def _store_rows(out_ptr, acc, l_i, token, head, row_ok, stride_out_t, stride_out_h, HEAD_DIM_V: tl.constexpr,
                HEAD_DIM_V_PAD: tl.constexpr):  # fmt: skip
    # Normalise and write the valid rows of a [BLOCK_M, HEAD_DIM_V_PAD] accumulator.
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_ok[:, None]
    if HEAD_DIM_V_PAD != HEAD_DIM_V:
        out_mask = out_mask & (offs_dv < HEAD_DIM_V)[None, :]
    out_ptrs = out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + offs_dv[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
