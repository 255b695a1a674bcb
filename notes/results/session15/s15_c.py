"""Session 15 probe C: is the block-table gather what holds our prefill tiles at ~57-60% of cuDNN?

1. Our paged_attention over a fresh prefill (1 x 4096, 1 x 8192, Qwen3 heads 16/8 x 128, bf16) with the cache in
   blocks of 16, 64 and 256 slots (fewer, longer contiguous runs per tile).
2. A dense causal forward written for this probe: K/V (and Q) from the step's contiguous packed rows through TMA
   tensor descriptors, tiles and stages swept. If it reaches ~cuDNN, a paged kernel variant that reads the chunk's own
   keys this way is worth building; if it stays near our tiles, the gathers are not the limit.
CUDA-graph timing (GPU time only). `--smoke` checks the dense kernel against SDPA on the CPU interpreter.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

H, KVH, D = 16, 8, 128
OUT = os.environ.get("OUT", ".")


@triton.jit
def _dense_causal(q_desc, k_desc, v_desc, o_ptr, qk_scale, T, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    num_m = tl.cdiv(T, BLOCK_M)
    start_m = (num_m - 1 - tl.program_id(0)) * BLOCK_M  # heaviest query blocks first
    head = tl.program_id(1)
    kv_col = (head // (H // KVH)) * D
    q = q_desc.load([start_m, head * D])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, start_m, BLOCK_N, num_stages=STAGES):
        k = k_desc.load([start_n, kv_col])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, kv_col])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    for start_n in range(start_m, start_m + BLOCK_M, BLOCK_N):
        k = k_desc.load([start_n, kv_col])
        s = tl.dot(q, k.T)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, kv_col])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + offs_m[:, None] * (H * D) + head * D + tl.arange(0, D)[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(offs_m < T)[:, None])


def dense(q, k, v, block_m, block_n, warps, stages):
    T = q.shape[0]
    q2, k2, v2 = q.view(T, H * D), k.view(T, KVH * D), v.view(T, KVH * D)
    qd = TensorDescriptor(q2, shape=[T, H * D], strides=[H * D, 1], block_shape=[block_m, D])
    kd = TensorDescriptor(k2, shape=[T, KVH * D], strides=[KVH * D, 1], block_shape=[block_n, D])
    vd = TensorDescriptor(v2, shape=[T, KVH * D], strides=[KVH * D, 1], block_shape=[block_n, D])
    o = torch.empty_like(q)
    grid = (triton.cdiv(T, block_m), H)
    _dense_causal[grid](qd, kd, vd, o, D**-0.5 * 1.4426950408889634, T, H, KVH, D, block_m, block_n, stages,
                        num_warps=warps)
    return o


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )[0].transpose(0, 1)


def graph_ms(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def main():
    from hfpaged.kernels import paged_attention

    res = {"device": torch.cuda.get_device_name(), "paged": [], "dense": [], "sdpa": []}
    dev = "cuda"
    for T in (4096, 8192):
        flops = 4 * H * D * T * (T + 1) / 2
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
        ref = sdpa(q, k, v)
        ms = graph_ms(lambda: sdpa(q, k, v))
        res["sdpa"].append(dict(T=T, ms=ms, tflops=flops / ms / 1e9))
        print("sdpa", T, round(flops / ms / 1e9, 1), flush=True)
        for bs in (16, 64, 256):
            nb = T // bs
            perm = torch.randperm(nb + 4)[:nb].to(dev)
            k_cache = torch.zeros(nb + 4, bs, KVH, D, device=dev, dtype=torch.bfloat16)
            v_cache = torch.zeros_like(k_cache)
            k_cache[perm] = k.view(nb, bs, KVH, D)
            v_cache[perm] = v.view(nb, bs, KVH, D)
            tables = perm.int()[None]
            lens = torch.tensor([T], dtype=torch.int32, device=dev)
            cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
            fn = lambda: paged_attention(q, k_cache, v_cache, tables, lens, cu, scale=D**-0.5, max_seqlen_q=T,
                                         max_seqlen_k=T)
            try:
                err = float((fn().float() - ref.float()).abs().max())
                ms = graph_ms(fn)
                res["paged"].append(dict(T=T, block_size=bs, ms=ms, tflops=flops / ms / 1e9, max_err=err))
                print("paged", T, bs, round(flops / ms / 1e9, 1), err, flush=True)
            except Exception as e:
                res["paged"].append(dict(T=T, block_size=bs, error=repr(e)[:300]))
                print("paged", T, bs, repr(e)[:300], flush=True)
        for bm, bn, w, st in [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4),
                              (128, 128, 4, 2), (64, 128, 4, 3), (64, 64, 4, 4)]:
            try:
                fn = lambda: dense(q, k, v, bm, bn, w, st)
                err = float((fn().float() - ref.float()).abs().max())
                ms = graph_ms(fn)
                row = dict(T=T, block_m=bm, block_n=bn, warps=w, stages=st, ms=ms, tflops=flops / ms / 1e9, max_err=err)
            except Exception as e:
                row = dict(T=T, block_m=bm, block_n=bn, warps=w, stages=st, error=repr(e)[:300])
            res["dense"].append(row)
            print("dense", json.dumps(row), flush=True)
        with open(os.path.join(OUT, "s15_c.json"), "w") as f:
            json.dump(res, f, indent=1)


def smoke():
    torch.manual_seed(0)
    T = 200
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    out = dense(q, k, v, 64, 32, 4, 2)
    ref = sdpa(q, k, v)
    print("smoke max err", float((out - ref).abs().max()))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":
    smoke() if "--smoke" in sys.argv else main()
