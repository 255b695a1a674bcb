// Decode attention over an fp8 (e4m3 / e5m2) paged KV cache: one query token per sequence, one CTA per
// (sequence, KV head), NWARPS warps that each walk every NWARPS-th 16-key tile of the sequence through a
// per-warp cp.async ring of NSTAGES tiles, then merge their partial softmaxes through shared memory.
// Compiled at run time by NVRTC (kernels/fp8_decode.py prepends the #defines); no headers.
//
// Per 16-key tile and warp (tensor cores, mma.sync m16n8k16, fp16 in / fp32 accumulate):
//   S = q K^T     A = q (16 rows: the GROUP query heads of the KV head, the rest zero), B = K^T: ldmatrix of the fp8
//                 K rows gives each thread 4 consecutive bytes of one key, converted to two f16x2 registers that
//                 stand for dims (2c, 2c+1) and (2c+8, 2c+9) of the k-step: the query's dims are loaded in the
//                 same permuted order, and the dot product does not care about the order of its terms.
//   O^T += V^T P^T  A = V^T: ldmatrix.trans of the fp8 V rows (as 16-bit pairs) gives each thread bytes of two
//                 keys x two dims; one PRMT regroups them into (two keys of one dim) pairs, converted to f16x2: the
//                 dims of an m-tile come out interleaved (row g = dim 2g, row g+8 = dim 2g+1), undone on the
//                 write. B = P^T, whose fragment is exactly the S accumulator's layout (columns = keys).
// Scores in the log2 domain; q is scaled by a power of two into fp16's range (as the Triton kernel does), the
// factor and k_scale folded into qk_scale; v_scale is applied at the end.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define TILE 16
#define ROW_BYTES HEAD_DIM
#define CHUNKS (HEAD_DIM / 16)
#define TILE_BYTES (TILE * ROW_BYTES)
#define STAGE_BYTES (2 * TILE_BYTES)
#define NTHREADS (NWARPS * 32)
#define ROWS_PER_LINE ((128 / ROW_BYTES) > 0 ? (128 / ROW_BYTES) : 1)
#define SWZ_MASK ((CHUNKS - 1) < 7 ? (CHUNKS - 1) : 7)
#define NEG_INF (__int_as_float(0xff800000))

#if KV_E5M2
#define CVT_F16X2 "cvt.rn.f16x2.e5m2x2 %0, %1;"
#define CVT_FP8X2 "cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;"
#else
#define CVT_F16X2 "cvt.rn.f16x2.e4m3x2 %0, %1;"
#define CVT_FP8X2 "cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
#endif

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// byte offset of 16-byte chunk cc of row r inside a tile (XOR swizzle: the 8 rows one ldmatrix reads hit 8 banks)
__device__ __forceinline__ int swz(int r, int cc) { return r * ROW_BYTES + ((cc ^ ((r / ROWS_PER_LINE) & SWZ_MASK)) << 4); }

__device__ __forceinline__ u32 f8x2_to_f16x2(u32 pair16) {
    u32 r;
    u16 h = (u16)pair16;
    asm(CVT_F16X2 : "=r"(r) : "h"(h));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 pack_out(float lo, float hi) {
    u32 r;
#if Q_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

__device__ __forceinline__ float half_to_float(u16 x) {
#if Q_BF16
    return __int_as_float(((u32)x) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
#endif
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// max that propagates NaN (a NaN query row must stay NaN, as in the Triton kernel; fmaxf would drop it)
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(r) : "r"(a), "r"(sel));
    return r;
}

__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ float div_full(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Two values as the cache stores them (what store_kv's to_cache writes): x / scale, saturated, rounded to fp8.
__device__ __forceinline__ u16 quantize2(float lo, float hi, float scale) {
    lo = fminf(fmaxf(div_full(lo, scale), -FP8_MAX), FP8_MAX);
    hi = fminf(fmaxf(div_full(hi, scale), -FP8_MAX), FP8_MAX);
    u16 r;
    asm(CVT_FP8X2 : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

extern "C" __global__ void __launch_bounds__(NTHREADS) hfpaged_fp8_decode(
    const u16* __restrict__ q,        // [B, H, D] bf16 / fp16
    u8* k_cache,                      // [blocks, BLOCK_SIZE, KVH, D] fp8 bytes (written by the store)
    u8* v_cache,
    const int* __restrict__ block_tables,
    const int* __restrict__ seq_lens,
    const float* __restrict__ k_scale_ptr,
    const float* __restrict__ v_scale_ptr,
    u16* __restrict__ out,            // [B, H, D]
    const u16* __restrict__ store_key,    // [B, KVH, D] (STORE_KV)
    const u16* __restrict__ store_value,
    const void* __restrict__ slots,   // [B] int32 or int64 (slots_64), -1 = none
    float* __restrict__ split_acc,    // num_splits > 1: [B, H, num_splits, D] fp32 partials (x v_scale)
    float* __restrict__ split_max,    // [B, H, num_splits] (log2 domain; -inf: no key)
    float* __restrict__ split_sum,    // [B, H, num_splits]
    const int* __restrict__ cu_seqlens_q,  // null, or [B + 1]: only sequences b with cu[b] = b, cu[b + 1] = b + 1 (the
                                      // leading one-token rows of a mixed step) are computed, the others left alone
    // 8-byte integers, then the one float: fp8_decode.py packs them in this order with no padding
    long long num_splits_ll, long long min_split_keys_ll, long long slots_64,
    long long stride_q_t, long long stride_q_h,
    long long stride_k_b, long long stride_k_s, long long stride_k_h,
    long long stride_v_b, long long stride_v_s, long long stride_v_h,
    long long stride_bt, long long stride_o_t, long long stride_o_h,
    long long stride_sk_t, long long stride_sk_h, long long stride_sv_t, long long stride_sv_h,
    float qk_scale_in) {               // softmax scale * log2(e)
    const int num_splits = (int)num_splits_ll, min_split_keys = (int)min_split_keys_ll;
    extern __shared__ __align__(128) u8 smem[];
    const int b = blockIdx.x, h = blockIdx.y;
    if (cu_seqlens_q != nullptr && (cu_seqlens_q[b] != b || cu_seqlens_q[b + 1] != b + 1)) return;  // the whole CTA
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int seq_len = seq_lens[b];
    // keys [kbeg, kend) of this CTA: all of them, or with num_splits > 1 (flash-decoding) a tile-aligned share of
    // at least min_split_keys (later splits may be empty); ``_merge_splits_kernel`` combines the partials
    int kbeg = 0, kend = seq_len > 0 ? seq_len : 0;
    if (num_splits > 1) {
        int per = (kend + num_splits - 1) / num_splits;
        per = per > min_split_keys ? per : min_split_keys;
        per = (per + TILE - 1) / TILE * TILE;
        kbeg = blockIdx.z * per;
        kend = kend < kbeg + per ? kend : kbeg + per;
    }
    const int tile_beg = kbeg / TILE;
    const int num_tiles = kend > kbeg ? (kend - kbeg + TILE - 1) / TILE : 0;
    const int* bt = block_tables + (long long)b * stride_bt;
    const u8* k_head = k_cache + (long long)h * stride_k_h;
    const u8* v_head = v_cache + (long long)h * stride_v_h;
    const float k_scale = *k_scale_ptr;

#if STORE_KV
    {
        const long long slot = slots_64 ? ((const long long*)slots)[b] : (long long)((const int*)slots)[b];
        // the CTA whose keys include the last one writes it (no other CTA reads that key)
        if (slot >= 0 && (num_splits == 1 || (seq_len - 1 >= kbeg && seq_len - 1 < kend))) {  // this token's K/V row, quantized as store_kv would, then read back by the loop below
            const long long blk = slot / BLOCK_SIZE;
            const int off = (int)(slot % BLOCK_SIZE);
            const float v_scale_s = *v_scale_ptr;
            for (int i = threadIdx.x; i < HEAD_DIM; i += NTHREADS) {  // i < D/2: K pair i, else V pair i - D/2
                const bool is_v = i >= HEAD_DIM / 2;
                const int d = 2 * (is_v ? i - HEAD_DIM / 2 : i);
                const u16* src = is_v ? store_value + (long long)b * stride_sv_t + (long long)h * stride_sv_h
                                      : store_key + (long long)b * stride_sk_t + (long long)h * stride_sk_h;
                u8* dst = is_v ? v_cache + blk * stride_v_b + (long long)off * stride_v_s + (long long)h * stride_v_h
                               : k_cache + blk * stride_k_b + (long long)off * stride_k_s + (long long)h * stride_k_h;
                const float lo = half_to_float(src[d]), hi = half_to_float(src[d + 1]);
                *(u16*)(dst + d) = quantize2(lo, hi, is_v ? v_scale_s : k_scale);
            }
        }
        __syncthreads();
    }
#endif

    // q fragments (rows g < GROUP: query head h * GROUP + g; dims of k-step j in the permuted order)
    float qv[CHUNKS][4];
    float qmax = 0.f;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        if (g < GROUP) {
            const u16* src = q + (long long)b * stride_q_t + (long long)(h * GROUP + g) * stride_q_h + 16 * j + 4 * c;
            const uint2 raw = *(const uint2*)src;
            qv[j][0] = half_to_float((u16)raw.x);
            qv[j][1] = half_to_float((u16)(raw.x >> 16));
            qv[j][2] = half_to_float((u16)raw.y);
            qv[j][3] = half_to_float((u16)(raw.y >> 16));
        } else {
            qv[j][0] = qv[j][1] = qv[j][2] = qv[j][3] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float a = fabsf(qv[j][e]);
            if (a < __int_as_float(0x7f800000)) qmax = fmaxf(qmax, a);  // finite only
        }
    }
    float q_mult = 1.f;
#if Q_BF16
    // bf16 queries: scaled by a power of two so the largest |q| lands in [2^13, 2^14): exact in fp16
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) qmax = fmaxf(qmax, __shfl_xor_sync(0xffffffffu, qmax, o));
    {
        const int q_exp = (__float_as_int(qmax) >> 23) & 0xff;
        int mult_exp = 267 - q_exp;
        mult_exp = mult_exp < 1 ? 1 : (mult_exp > 254 ? 254 : mult_exp);
        q_mult = qmax > 1e-30f ? __int_as_float(mult_exp << 23) : 1.f;
    }
#endif
    u32 qa[CHUNKS][2];
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        qa[j][0] = pack_f16x2(qv[j][0] * q_mult, qv[j][1] * q_mult);
        qa[j][1] = pack_f16x2(qv[j][2] * q_mult, qv[j][3] * q_mult);
    }
    const float qk = qk_scale_in * k_scale / q_mult;

    // this warp's tiles: warp, warp + NWARPS, ...
    const int n_my = num_tiles > warp ? (num_tiles - warp + NWARPS - 1) / NWARPS : 0;
    u8* ring = smem + warp * (NSTAGES * STAGE_BYTES);
    const u32 ring_u32 = smem_u32(ring);

    auto issue = [&](int i) {
        if (i < n_my) {
            const int key0 = (tile_beg + warp + i * NWARPS) * TILE;
            const long long blk = (long long)bt[key0 / BLOCK_SIZE];
            const int off0 = key0 % BLOCK_SIZE;
            const int valid = seq_len - key0;  // >= 1
            const u32 st = ring_u32 + (i % NSTAGES) * STAGE_BYTES;
            const u8* kb = k_head + blk * stride_k_b;
            const u8* vb = v_head + blk * stride_v_b;
#pragma unroll
            for (int r = 0; r < TILE * CHUNKS / 32; ++r) {
                const int idx = lane + 32 * r;
                const int row = idx / CHUNKS, cc = idx % CHUNKS;
                const int bytes = row < valid ? 16 : 0;  // zero-fill past the sequence's end
                const int srow = row < valid ? off0 + row : off0;
                cp_async16(st + swz(row, cc), kb + (long long)srow * stride_k_s + cc * 16, bytes);
                cp_async16(st + TILE_BYTES + swz(row, cc), vb + (long long)srow * stride_v_s + cc * 16, bytes);
            }
        }
        cp_async_commit();
    };

    float o[CHUNKS][4];
#pragma unroll
    for (int mt = 0; mt < CHUNKS; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float m_i = NEG_INF, l_i = 0.f;

    // ldmatrix row addresses: matrix mi = lane / 8 covers keys (mi & 1) * 8 .. +7 of chunk cc + (mi >> 1)
    const int lm_row = ((lane >> 3) & 1) * 8 + (lane & 7);
    const int lm_cc = lane >> 4;

#pragma unroll
    for (int i = 0; i < NSTAGES - 1; ++i) issue(i);

    for (int i = 0; i < n_my; ++i) {
        cp_async_wait<NSTAGES - 2>();
        __syncwarp();
        issue(i + NSTAGES - 1);  // into the stage read in iteration i - 1 (every lane is past it)
        const u32 sk = ring_u32 + (i % NSTAGES) * STAGE_BYTES;
        const u32 sv = sk + TILE_BYTES;
        const int key0 = (tile_beg + warp + i * NWARPS) * TILE;

        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < CHUNKS; j += 2) {
            u32 k0, k1, k2, k3;
            ldsm_x4(sk + swz(lm_row, j + lm_cc), k0, k1, k2, k3);
            mma16816(s0, qa[j][0], 0u, qa[j][1], 0u, f8x2_to_f16x2(k0), f8x2_to_f16x2(k0 >> 16));
            mma16816(s1, qa[j][0], 0u, qa[j][1], 0u, f8x2_to_f16x2(k1), f8x2_to_f16x2(k1 >> 16));
            mma16816(s0, qa[j + 1][0], 0u, qa[j + 1][1], 0u, f8x2_to_f16x2(k2), f8x2_to_f16x2(k2 >> 16));
            mma16816(s1, qa[j + 1][0], 0u, qa[j + 1][1], 0u, f8x2_to_f16x2(k3), f8x2_to_f16x2(k3 >> 16));
        }
        // row g's scores of keys 2c, 2c+1 (s0) and 8+2c, 9+2c (s1), log2 domain
        float x0 = s0[0] * qk, x1 = s0[1] * qk, x2 = s1[0] * qk, x3 = s1[1] * qk;
        if (key0 + TILE > seq_len) {
            const int lim = seq_len - key0;
            if (2 * c >= lim) x0 = NEG_INF;
            if (2 * c + 1 >= lim) x1 = NEG_INF;
            if (8 + 2 * c >= lim) x2 = NEG_INF;
            if (9 + 2 * c >= lim) x3 = NEG_INF;
        }
        float mx = fmax_nan(fmax_nan(x0, x1), fmax_nan(x2, x3));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmax_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmax_nan(m_i, mx);
        const float m_use = m_new == NEG_INF ? 0.f : m_new;
        const float alpha = ex2(m_i - m_use);
        const float p0 = ex2(x0 - m_use), p1 = ex2(x1 - m_use), p2 = ex2(x2 - m_use), p3 = ex2(x3 - m_use);
        l_i = l_i * alpha + ((p0 + p1) + (p2 + p3));
        m_i = m_new;
        // O^T columns are query rows 2c, 2c+1: their alphas live on lanes 8c and 8c + 4
        const float a_even = __shfl_sync(0xffffffffu, alpha, 8 * c);
        const float a_odd = __shfl_sync(0xffffffffu, alpha, 8 * c + 4);
        const u32 pb0 = pack_f16x2(p0, p1), pb1 = pack_f16x2(p2, p3);
#pragma unroll
        for (int mt = 0; mt < CHUNKS; ++mt) {
            o[mt][0] *= a_even;
            o[mt][1] *= a_odd;
            o[mt][2] *= a_even;
            o[mt][3] *= a_odd;
        }
#pragma unroll
        for (int cc = 0; cc < CHUNKS; cc += 2) {
            u32 v0, v1, v2, v3;
            ldsm_x4_t(sv + swz(lm_row, cc + lm_cc), v0, v1, v2, v3);
            // v0: bytes V[2c][2g], V[2c][2g+1], V[2c+1][2g], V[2c+1][2g+1] (keys 0-7); v1 the same for keys 8-15
            const u32 w0 = prmt(v0, 0x3120), w1 = prmt(v1, 0x3120);
            const u32 w2 = prmt(v2, 0x3120), w3 = prmt(v3, 0x3120);
            mma16816(o[cc], f8x2_to_f16x2(w0), f8x2_to_f16x2(w0 >> 16), f8x2_to_f16x2(w1), f8x2_to_f16x2(w1 >> 16),
                     pb0, pb1);
            mma16816(o[cc + 1], f8x2_to_f16x2(w2), f8x2_to_f16x2(w2 >> 16), f8x2_to_f16x2(w3),
                     f8x2_to_f16x2(w3 >> 16), pb0, pb1);
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the rings are reused below

    // merge the warps: partial (m, l, O) of each warp's query rows through shared memory
    float* red_o = (float*)smem;                       // [NWARPS][GROUP][HEAD_DIM]
    float* red_m = red_o + NWARPS * GROUP * HEAD_DIM;  // [NWARPS][GROUP]
    float* red_l = red_m + NWARPS * GROUP;
    l_i += __shfl_xor_sync(0xffffffffu, l_i, 1);
    l_i += __shfl_xor_sync(0xffffffffu, l_i, 2);
    if (c == 0 && g < GROUP) {
        red_m[warp * GROUP + g] = m_i;
        red_l[warp * GROUP + g] = l_i;
    }
#pragma unroll
    for (int mt = 0; mt < CHUNKS; ++mt) {
        const int d = 16 * mt + 2 * g;
        if (2 * c < GROUP) *(float2*)(red_o + (warp * GROUP + 2 * c) * HEAD_DIM + d) = make_float2(o[mt][0], o[mt][2]);
        if (2 * c + 1 < GROUP)
            *(float2*)(red_o + (warp * GROUP + 2 * c + 1) * HEAD_DIM + d) = make_float2(o[mt][1], o[mt][3]);
    }
    __syncthreads();
    const float v_scale = *v_scale_ptr;
    for (int idx = threadIdx.x; idx < GROUP * HEAD_DIM / 2; idx += NTHREADS) {
        const int r = idx / (HEAD_DIM / 2), d = 2 * (idx % (HEAD_DIM / 2));
        float mmax = NEG_INF;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) mmax = fmax_nan(mmax, red_m[w * GROUP + r]);
        float acc0 = 0.f, acc1 = 0.f, l = 0.f;
        if (mmax != NEG_INF) {
#pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float wt = ex2(red_m[w * GROUP + r] - mmax);
                l += red_l[w * GROUP + r] * wt;
                const float2 part = *(const float2*)(red_o + (w * GROUP + r) * HEAD_DIM + d);
                acc0 += part.x * wt;
                acc1 += part.y * wt;
            }
        }
        if (num_splits > 1) {  // the unnormalised partial, as the Triton kernel writes it
            const long long row = ((long long)b * gridDim.y * GROUP + h * GROUP + r) * num_splits + blockIdx.z;
            *(float2*)(split_acc + row * HEAD_DIM + d) = make_float2(acc0 * v_scale, acc1 * v_scale);
            if (d == 0) {
                split_max[row] = mmax;
                split_sum[row] = l;
            }
            continue;
        }
        const float inv = l == 0.f ? 1.f : l;
        const u32 packed = pack_out(div_full(acc0 * v_scale, inv), div_full(acc1 * v_scale, inv));
        *(u32*)(out + (long long)b * stride_o_t + (long long)(h * GROUP + r) * stride_o_h + d) = packed;
    }
}
