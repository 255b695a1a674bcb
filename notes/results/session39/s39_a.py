"""Session 39 probe A: prompt attention of one fresh causal prompt on Hopper.

Compares, CUDA-graph timed, TFLOP/s with the causal half of the FLOPs: SDPA's default (cuDNN), our paged kernel with
the step rows (the engine's path, ``paged_attention(..., key=, value=)``) at today's long-prompt tile and other tiles,
and a Gluon forward (``gl_attn.py``) with FA3's intra-warpgroup overlap on and off. Outputs against SDPA.

    OUT=dir python notes/results/session39/s39_a.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gl_attn

from hfpaged import kernels
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config

OUT = os.environ.get("OUT", ".")
BS = 16


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
    times = []
    for _ in range(5):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return sorted(times)[2]


def case(heads, kv_heads, dim, n, tiles):
    torch.manual_seed(0)
    q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    nb = (n + BS - 1) // BS
    perm = torch.randperm(nb + 4)[:nb].cuda()
    k_cache = torch.zeros(nb + 4, BS, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[perm] = k.view(nb, BS, kv_heads, dim)
    v_cache[perm] = v.view(nb, BS, kv_heads, dim)
    tables = perm.int()[None]
    seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    flops = 4 * heads * dim * n * (n + 1) / 2
    scale = dim**-0.5

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
            enable_gqa=True)[0].transpose(0, 1)  # fmt: skip

    def ours():
        return kernels.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=scale, max_seqlen_q=n,
                                       max_seqlen_k=n, key=k, value=v)  # fmt: skip

    def ours_tile(t):
        return lambda: paged_attention_with_config(
            q, k_cache, v_cache, tables, seq_lens, cu, scale=scale, config=AttentionConfig(*t), step_kv=(k, v)
        )

    def gluon(overlap, stages):
        return lambda: gl_attn.gl_attention(q, k, v, scale, overlap=overlap, stages=stages)

    def gluon_ws(pingpong, stages):
        return lambda: gl_attn.gl_attention_ws(q, k, v, scale, pingpong=pingpong, stages=stages)

    ref = sdpa().float()
    row = dict(heads=heads, kv_heads=kv_heads, dim=dim, n=n)
    fns = [("sdpa", sdpa), ("ours", ours)]
    fns += [(f"tile{t}", ours_tile(t)) for t in tiles]
    fns += [(f"gl_ov{int(o)}_s{s}", gluon(o, s)) for o in (True, False) for s in (2, 3)]
    if os.environ.get("WS", "1") == "1":
        fns += [(f"ws_pp{int(pp)}_s{s}", gluon_ws(pp, s)) for pp in (False, True) for s in (2, 3)]
    for name, fn in fns:
        try:
            o = fn()
            torch.cuda.synchronize()
            err = float((o.float() - ref).abs().max())
            ms = graph_ms(fn)
            row[name] = dict(us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1), err=round(err, 5))
        except Exception as exc:
            row[name] = dict(error=f"{type(exc).__name__}: {str(exc)[:400]}")
    base = row["sdpa"].get("us")
    for r in row.values():
        if isinstance(r, dict) and "us" in r and base:
            r["pct_cudnn"] = round(100 * base / r["us"], 1)
    print(json.dumps(row), flush=True)
    return row


def main():
    if os.environ.get("CHECK"):  # a small run of the warp-specialized kernels first (a hang is killed by timeout)
        torch.manual_seed(0)
        q = torch.randn(512, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(512, 8, 128, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1).float()  # fmt: skip
        for pp in (False, True):
            for st in (2, 3):
                o = gl_attn.gl_attention_ws(q, k, v, 128**-0.5, pingpong=pp, stages=st)
                torch.cuda.synchronize()
                print("ws check", pp, st, float((o.float() - ref).abs().max()), flush=True)
        return
    rows = []
    tiles = [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4)]
    shapes = [(16, 8, 128, n) for n in (2048, 4096, 8192, 16384)] + [(32, 8, 128, n) for n in (4096, 8192)]
    shapes += [(32, 8, 64, 4096)]
    for shape in shapes:
        rows.append(case(*shape, tiles if shape[2] == 128 else []))
        with open(os.path.join(OUT, "s39_a.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
