"""Session 39 probe B: prompt attention through ``paged_attention`` (the engine's call: q/key/value as views of
[1, heads, T, 128], the step's rows given) with the Gluon kernel for fresh prompts (prompt_gluon.py) on and off, against
SDPA's default (cuDNN). CUDA-graph timing, TFLOP/s with the causal half of the FLOPs; on/off outputs compared.

    OUT=dir python notes/results/session39/s39_b.py
"""

import importlib
import json
import os

import torch

from hfpaged.kernels import paged_attention

pg = importlib.import_module("hfpaged.kernels.prompt_gluon")
pa = importlib.import_module("hfpaged.kernels.paged_attention")
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


def case(heads, kv_heads, dim, lens, context=None):
    torch.manual_seed(0)
    context = context or [0] * len(lens)
    T = sum(lens)
    q = torch.randn(heads, T, dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)  # engine-like views
    k = torch.randn(kv_heads, T, dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    v = torch.randn(kv_heads, T, dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    seq = [c + n for c, n in zip(context, lens)]
    nbs = [(s + BS - 1) // BS for s in seq]
    nb = sum(nbs)
    k_cache = torch.randn(nb + 4, BS, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(nb + 4)[:nb].cuda()
    tables = torch.zeros(len(lens), max(nbs), dtype=torch.int32, device="cuda")
    at, tok = 0, 0
    for i, (n, c, m) in enumerate(zip(lens, context, nbs)):
        blocks = perm[at : at + m]
        tables[i, :m] = blocks.int()
        flat_k = k_cache[blocks].view(m * BS, kv_heads, dim)
        flat_v = v_cache[blocks].view(m * BS, kv_heads, dim)
        flat_k[c : c + n], flat_v[c : c + n] = k[tok : tok + n], v[tok : tok + n]
        k_cache[blocks], v_cache[blocks] = flat_k.view(m, BS, kv_heads, dim), flat_v.view(m, BS, kv_heads, dim)
        at, tok = at + m, tok + n
    seq_lens = torch.tensor(seq, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    flops = sum(4 * heads * dim * (n * c + n * (n + 1) / 2) for n, c in zip(lens, context))

    def ours(gluon):
        def run():
            pg.ENABLED = gluon
            return paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale=dim**-0.5, max_seqlen_q=max(lens),
                                   max_seqlen_k=max(seq), key=k, value=v)  # fmt: skip

        return run

    starts = cu.tolist()

    def sdpa():
        outs = []
        for i, n in enumerate(lens):
            s = starts[i]
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[s : s + n].transpose(0, 1)[None], k[s : s + n].transpose(0, 1)[None],
                v[s : s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)[0].transpose(0, 1))  # fmt: skip
        return outs

    calls = []
    real = pa.attend_fresh_prompts
    pa.attend_fresh_prompts = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    o_on, o_off = ours(True)(), ours(False)()
    pa.attend_fresh_prompts = real
    row = dict(heads=heads, kv_heads=kv_heads, dim=dim, lens=lens, context=context, gluon_ran=len(calls))
    row["bitwise_equal"] = bool(torch.equal(o_on, o_off))
    row["max_diff_on_off"] = float((o_on.float() - o_off.float()).abs().max())
    if not any(context):
        ref = torch.cat(sdpa()).float()
        row["err_on"] = float((o_on.float() - ref).abs().max())
        row["err_off"] = float((o_off.float() - ref).abs().max())
    fns = [("on", ours(True)), ("off", ours(False))] + ([("sdpa", sdpa)] if not any(context) else [])
    for name, fn in fns:
        ms = graph_ms(fn)
        row[name] = dict(us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1))
    pg.ENABLED = True
    row["on_vs_off"] = round(row["off"]["us"] / row["on"]["us"], 3)
    if "sdpa" in row:
        row["on_pct_sdpa"] = round(100 * row["sdpa"]["us"] / row["on"]["us"], 1)
        row["off_pct_sdpa"] = round(100 * row["sdpa"]["us"] / row["off"]["us"], 1)
    print(json.dumps(row), flush=True)
    return row


def main():
    rows = []
    shapes = [(16, 8, 128, [n]) for n in (1024, 2048, 4096, 8192, 16384)]
    shapes += [(16, 8, 128, [4096] * 2), (16, 8, 128, [2048] * 4), (16, 8, 128, [512] * 16)]
    shapes += [(16, 8, 128, [5000, 7000, 4200, 6100])]  # long workload-like
    shapes += [(32, 8, 128, [n]) for n in (4096, 8192)] + [(32, 32, 128, [4096])]
    cases = [(s, None) for s in shapes]
    cases += [((16, 8, 128, [4096, 2000, 1, 1]), [0, 3000, 500, 800])]  # fresh + a continuation + decode rows
    for shape, context in cases:
        try:
            rows.append(case(*shape, context=context))
        except Exception as exc:
            rows.append(dict(shape=str(shape), error=f"{type(exc).__name__}: {str(exc)[:400]}"))
            print(rows[-1], flush=True)
        with open(os.path.join(OUT, "s39_b.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
