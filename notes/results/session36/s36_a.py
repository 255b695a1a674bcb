"""Session 36 probe A: the prompt launches' program order, KV heads innermost (new) against heads outermost (old).

The old grid was (programs, KV heads): the GPU starts programs in grid order, so one head's blocks (heaviest causal
block first) all started before the next head's, and the last head's heavy blocks ran in the tail. The new grid is
flat with the heads innermost. Outputs must be bitwise equal (each program computes the same thing). CUDA-graph
timing, fresh causal prompts whose K/V are the step's own rows (as the engine passes them), TFLOP/s with the causal
half of the FLOPs, against SDPA's default (cuDNN) with GQA. The old kernels are a copy of HEAD's ``kernels/`` as the
package ``oldkernels`` beside this file (made by the call script).

    OUT=dir python notes/results/session36/s36_a.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oldkernels

from hfpaged import kernels as newkernels

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


def case(heads, kv_heads, dim, lens):
    torch.manual_seed(0)
    T = sum(lens)
    q = torch.randn(T, heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    nbs = [(n + BS - 1) // BS for n in lens]
    nb = sum(nbs)
    perm = torch.randperm(nb + 4)[:nb].cuda()
    k_cache = torch.zeros(nb + 4, BS, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int32, device="cuda")
    at, tok = 0, 0
    for i, (n, m) in enumerate(zip(lens, nbs)):
        blocks = perm[at : at + m]
        tables[i, :m] = blocks.int()
        kp = torch.zeros(m * BS, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        vp = torch.zeros_like(kp)
        kp[:n], vp[:n] = k[tok : tok + n], v[tok : tok + n]
        k_cache[blocks], v_cache[blocks] = kp.view(m, BS, kv_heads, dim), vp.view(m, BS, kv_heads, dim)
        at, tok = at + m, tok + n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    flops = sum(4 * heads * dim * n * (n + 1) / 2 for n in lens)

    def ours(mod):
        return lambda: mod.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=dim**-0.5,
                                           max_seqlen_q=max(lens), max_seqlen_k=max(lens), key=k, value=v)  # fmt: skip

    starts = cu.tolist()

    def sdpa():
        outs = []
        for i, n in enumerate(lens):
            s = starts[i]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[s : s + n].transpose(0, 1)[None], k[s : s + n].transpose(0, 1)[None],
                v[s : s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
        return outs

    row = dict(heads=heads, kv_heads=kv_heads, dim=dim, lens=lens if len(set(lens)) > 1 else f"{len(lens)}x{lens[0]}")
    o_old, o_new = ours(oldkernels)(), ours(newkernels)()
    row["bitwise_equal"] = bool(torch.equal(o_old, o_new))
    ref = torch.cat(sdpa())
    row["max_err_vs_sdpa"] = float((o_new.float() - ref.float()).abs().max())
    for name, fn in (("sdpa", sdpa), ("old", ours(oldkernels)), ("new", ours(newkernels))):
        ms = graph_ms(fn)
        row[name] = dict(us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1))
    row["new_vs_old"] = round(row["old"]["us"] / row["new"]["us"], 3)
    row["new_pct_sdpa"] = round(100 * row["sdpa"]["us"] / row["new"]["us"], 1)
    row["old_pct_sdpa"] = round(100 * row["sdpa"]["us"] / row["old"]["us"], 1)
    print(json.dumps(row), flush=True)
    return row


def main():
    rows = []
    shapes = [(16, 8, 128, [n]) for n in (1024, 2048, 4096, 8192, 16384)]
    shapes += [(16, 8, 128, [4096] * 2), (16, 8, 128, [2048] * 4), (16, 8, 128, [1024] * 8), (16, 8, 128, [512] * 16)]
    shapes += [(16, 8, 128, [5000, 7000, 4200, 6100])]  # long workload-like
    shapes += [(32, 8, 64, [n]) for n in (4096, 8192)] + [(32, 8, 128, [n]) for n in (4096, 8192)]
    for shape in shapes:
        try:
            rows.append(case(*shape))
        except Exception as exc:
            rows.append(dict(shape=str(shape), error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(rows[-1], flush=True)
        with open(os.path.join(OUT, "s36_a.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
