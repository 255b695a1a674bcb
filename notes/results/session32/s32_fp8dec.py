"""Session 32 probe: the CUDA fp8 decode kernel (kernels/fp8_decode.py) against the Triton kernel, on the GPU.

    python notes/results/session32/s32_fp8dec.py [--out DIR] [--quick]

1. Exactness checks: outputs of the CUDA kernel vs the Triton one and vs a float64 reference over the dequantized
   cache (unused cache bytes filled with NaN patterns; partial tiles, 0/1-key sequences, block sizes 16/32, e4m3 and
   e5m2, bf16/fp16 queries, groups 1-8, heads of 64/128 dims), and the fused store: cache bytes equal store_kv's.
2. Timing (CUDA graphs of 10 calls, replayed): us per call and TB/s of K/V bytes, CUDA kernel per (warps, stages)
   vs the Triton kernel with fp8 caches and with bf16 caches, at engine-like decode shapes.
"""

import argparse
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
import hfpaged.kernels.fp8_decode as fd  # noqa: E402
import hfpaged.kernels.paged_attention  # noqa: E402
from hfpaged.kernels import store_kv  # noqa: E402

pa = sys.modules["hfpaged.kernels.paged_attention"]

DEV = "cuda"


def cdiv(a, b):
    return (a + b - 1) // b


def make_problem(lens, heads, kv_heads, dim, bs, kv_dtype, q_dtype, seed, nan_fill=True):
    torch.manual_seed(seed)
    B = len(lens)
    nblocks = [max(1, cdiv(n, bs)) for n in lens]
    total = sum(nblocks) + 3
    perm = torch.randperm(total).tolist()
    width = max(nblocks) + 2
    tables = torch.zeros(B, width, dtype=torch.int32)
    kf = torch.randn(total, bs, kv_heads, dim, device=DEV) * 2
    vf = torch.randn(total, bs, kv_heads, dim, device=DEV)
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8:
        limit = 448.0 if kv_dtype == torch.float8_e4m3fn else 57344.0
        k_scale = (kf.abs().max() / limit).reshape(1).float()
        v_scale = (vf.abs().max() / limit).reshape(1).float()
        k_cache = (kf / k_scale).to(kv_dtype)
        v_cache = (vf / v_scale).to(kv_dtype)
    else:
        k_scale = v_scale = None
        k_cache, v_cache = kf.to(kv_dtype), vf.to(kv_dtype)
    pos = 0
    for b, n in enumerate(lens):
        ids = perm[pos : pos + nblocks[b]]
        pos += nblocks[b]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if nan_fill and fp8:  # bytes past the sequence's end: NaN patterns (a masked key must not leak NaN)
            last = ids[-1]
            used = n - (len(ids) - 1) * bs if n > 0 else 0
            k_cache.view(torch.uint8)[last, used:] = 0x7F
            v_cache.view(torch.uint8)[last, used:] = 0x7F
    del kf, vf
    q = (torch.randn(B, heads, dim) * 3).to(q_dtype)
    to = lambda t: None if t is None else t.to(DEV)
    return dict(
        q=to(q), k_cache=to(k_cache), v_cache=to(v_cache), tables=to(tables),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), k_scale=to(k_scale), v_scale=to(v_scale),
        max_k=max(max(lens), 1),
    )  # fmt: skip


def reference(p, scale):
    q, kc, vc = p["q"].double(), p["k_cache"], p["v_cache"]
    ks = p["k_scale"].double() if p["k_scale"] is not None else 1.0
    vs = p["v_scale"].double() if p["v_scale"] is not None else 1.0
    bs = kc.shape[1]
    out = torch.zeros_like(q)
    group = q.shape[1] // kc.shape[2]
    for b, n in enumerate(p["seq_lens"].tolist()):
        if n == 0:
            continue
        blocks = p["tables"][b, : cdiv(n, bs)].long()
        k = kc[blocks].reshape(-1, kc.shape[2], kc.shape[3])[:n].double() * ks
        v = vc[blocks].reshape(-1, vc.shape[2], vc.shape[3])[:n].double() * vs
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b], k) * scale
        out[b] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


def call(p, scale, use_cuda, store=None):
    fd.USE_CUDA_FP8_DECODE = use_cuda
    B = p["q"].shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    kw = {}
    if store is not None:
        kw = dict(key=store[0], value=store[1], slot_mapping=store[2])
    return pa.paged_attention(
        p["q"], p["k_cache"], p["v_cache"], p["tables"], p["seq_lens"], cu, scale=scale, max_seqlen_q=1,
        max_seqlen_k=p["max_k"], k_scale=p["k_scale"], v_scale=p["v_scale"], **kw,
    )  # fmt: skip


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_all(log):
    results = []
    cases = []
    for kv in (torch.float8_e4m3fn, torch.float8_e5m2):
        for qd in (torch.bfloat16, torch.float16):
            cases.append(dict(kv=kv, qd=qd, heads=16, kvh=8, dim=128, bs=16))
    cases += [
        dict(kv=torch.float8_e4m3fn, qd=torch.bfloat16, heads=32, kvh=8, dim=64, bs=16),
        dict(kv=torch.float8_e4m3fn, qd=torch.bfloat16, heads=32, kvh=8, dim=128, bs=32),
        dict(kv=torch.float8_e4m3fn, qd=torch.bfloat16, heads=8, kvh=8, dim=128, bs=16),
        dict(kv=torch.float8_e4m3fn, qd=torch.bfloat16, heads=64, kvh=8, dim=128, bs=16),
        dict(kv=torch.float8_e4m3fn, qd=torch.bfloat16, heads=14, kvh=2, dim=64, bs=16),
    ]
    rng = random.Random(0)
    for i, cse in enumerate(cases):
        lens = [0, 1, 2, 15, 16, 17, 31, 33, 64, 100, 257, 1000, 2049] + [rng.randint(1, 700) for _ in range(40)]
        p = make_problem(lens, cse["heads"], cse["kvh"], cse["dim"], cse["bs"], cse["kv"], cse["qd"], seed=i)
        scale = cse["dim"] ** -0.5
        fd.USE_CUDA_FP8_DECODE = True
        usable = fd.fp8_decode_usable(p["q"], p["k_cache"], p["v_cache"], sliding_window=None, softcap=None,
                                      sinks=None)  # fmt: skip
        out_c = call(p, scale, True)
        out_t = call(p, scale, False)
        ref = reference(p, scale)
        nz = p["seq_lens"] > 0
        r = dict(case={k: str(v) for k, v in cse.items()}, usable=usable,
                 cuda_vs_ref=rel(out_c[nz], ref[nz]), triton_vs_ref=rel(out_t[nz], ref[nz]),
                 cuda_vs_triton=rel(out_c[nz], out_t[nz]), cuda_nan=bool(out_c.isnan().any()),
                 max_abs_cuda_ref=float((out_c.double() - ref).abs().max()),
                 max_abs_triton_ref=float((out_t.double() - ref).abs().max()),
                 zero_len_rows_zero=bool((out_c[~nz] == 0).all()))  # fmt: skip
        # fused store: the step's K/V at each sequence's last slot (some -1), caches compared byte for byte
        B = len(lens)
        key = torch.randn(B, cse["kvh"], cse["dim"], device=DEV).to(cse["qd"]) * 2
        value = torch.randn(B, cse["kvh"], cse["dim"], device=DEV).to(cse["qd"])
        slots = []
        for b, n in enumerate(lens):
            if n == 0 or b % 7 == 3:
                slots.append(-1)
            else:
                blk = int(p["tables"][b, (n - 1) // cse["bs"]])
                slots.append(blk * cse["bs"] + (n - 1) % cse["bs"])
        outs, caches = [], []
        for use_cuda in (True, False):
            for slot_dtype in (torch.int64, torch.int32):
                q2 = dict(p, k_cache=p["k_cache"].clone(), v_cache=p["v_cache"].clone())
                sl = torch.tensor(slots, dtype=slot_dtype, device=DEV)
                outs.append(call(q2, scale, use_cuda, store=(key, value, sl)))
                caches.append((q2["k_cache"].view(torch.uint8), q2["v_cache"].view(torch.uint8)))
        q3 = dict(p, k_cache=p["k_cache"].clone(), v_cache=p["v_cache"].clone())
        store_kv(key, value, q3["k_cache"], q3["v_cache"], torch.tensor(slots, device=DEV),
                 k_scale=p["k_scale"], v_scale=p["v_scale"])  # fmt: skip
        ref_bytes = (q3["k_cache"].view(torch.uint8), q3["v_cache"].view(torch.uint8))
        r["store_bytes_equal"] = [bool(torch.equal(c[0], ref_bytes[0]) and torch.equal(c[1], ref_bytes[1])) for c in caches]
        r["store_out_cuda_vs_triton"] = rel(outs[0][nz], outs[2][nz])
        r["store_out_int32_eq_int64"] = bool(torch.equal(outs[0], outs[1]))
        ref2 = reference(dict(p, k_cache=q3["k_cache"], v_cache=q3["v_cache"]), scale)
        r["store_cuda_vs_ref"] = rel(outs[0][nz], ref2[nz])
        r["store_triton_vs_ref"] = rel(outs[2][nz], ref2[nz])
        log(json.dumps(r))
        results.append(r)
    return results


def time_graph(fn, reps=20, inner=10):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    times.sort()
    return times[len(times) // 2]


def bench_all(log, quick):
    rng = random.Random(1)
    shapes = {
        "256x512": [512] * 256,
        "256x1024": [1024] * 256,
        "256x2048": [2048] * 256,
        "128x2048": [2048] * 128,
        "64x4096": [4096] * 64,
        "nano_mid_256": [rng.randint(100, 1024) + 300 for _ in range(256)],
        "nano_late_256": [rng.randint(100, 1024) + rng.randint(0, 1024) for _ in range(256)],
        "nano_mid_128": [rng.randint(100, 1024) + 300 for _ in range(128)],
        "chat_256": [rng.randint(32, 512) + 64 for _ in range(256)],
        "24x6144_split": [6144] * 24,
        "16x4096_split": [4096] * 16,
        "8x8192_split": [8192] * 8,
        "long_mid_24": [rng.randint(4096, 8192) + 256 for _ in range(24)],
    }
    heads_list = {"qwen3": (16, 8, 128), "llama1b": (32, 8, 64), "llama8b": (32, 8, 128)}
    configs = [(4, 2), (4, 4), (8, 2)]
    if quick:
        configs = [(4, 2)]
    out = []
    for hname, (H, KVH, D) in heads_list.items():
        for sname, lens in shapes.items():
            if hname != "qwen3" and sname not in ("256x1024", "nano_mid_256", "chat_256", "24x6144_split"):
                continue
            row = dict(heads=hname, shape=sname)
            kv_bytes = sum(lens) * KVH * D * 2
            scale = D**-0.5
            p = make_problem(lens, H, KVH, D, 16, torch.float8_e4m3fn, torch.bfloat16, seed=5, nan_fill=False)
            row["triton_fp8_us"] = time_graph(lambda: call(p, scale, False))
            for w, s in configs:
                fd.NUM_WARPS, fd.NUM_STAGES = w, s
                try:
                    row[f"cuda_{w}w{s}s_us"] = time_graph(lambda: call(p, scale, True))
                    k = fd.get_kernel(torch.device(DEV), head_dim=D, group=H // KVH, block_size=16,
                                      kv_dtype=torch.float8_e4m3fn, q_dtype=torch.bfloat16, store=False)  # fmt: skip
                    row[f"cuda_{w}w{s}s_regs"] = k.registers
                except Exception as e:  # noqa: BLE001
                    row[f"cuda_{w}w{s}s_err"] = repr(e)[:200]
            fd.NUM_WARPS, fd.NUM_STAGES = 4, 4
            del p
            pb = make_problem(lens, H, KVH, D, 16, torch.bfloat16, torch.bfloat16, seed=5, nan_fill=False)
            row["triton_bf16_us"] = time_graph(lambda: call(pb, scale, False))
            del pb
            row["fp8_kv_mb"] = kv_bytes / 1e6
            row["triton_fp8_tbs"] = kv_bytes / row["triton_fp8_us"] / 1e6
            best = min((v, k) for k, v in row.items() if k.startswith("cuda_") and k.endswith("_us"))
            row["best_cuda"] = best[1]
            row["best_cuda_tbs"] = kv_bytes / best[0] / 1e6
            row["best_cuda_vs_triton_fp8"] = row["triton_fp8_us"] / best[0]
            row["best_cuda_vs_bf16_time"] = best[0] / row["triton_bf16_us"]
            log(json.dumps(row))
            out.append(row)
            torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    a = ap.parse_args()
    logf = open(os.path.join(a.out, "s32_fp8dec.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    checks = check_all(log)
    bench = [] if a.skip_bench else bench_all(log, a.quick)
    with open(os.path.join(a.out, "s32_fp8dec.json"), "w") as f:
        json.dump(dict(checks=checks, bench=bench), f, indent=1)
    worst = max(r["cuda_vs_ref"] for r in checks)
    log(f"worst cuda_vs_ref {worst:.3e}; worst triton_vs_ref {max(r['triton_vs_ref'] for r in checks):.3e}")
    log(f"all store bytes equal: {all(all(r['store_bytes_equal']) for r in checks)}")
    log(f"any NaN: {any(r['cuda_nan'] for r in checks)}; usable everywhere: {all(r['usable'] for r in checks)}")
    if bench:
        log("geomean best cuda vs triton fp8: %.3f" % math.exp(
            sum(math.log(r["best_cuda_vs_triton_fp8"]) for r in bench) / len(bench)))


if __name__ == "__main__":
    main()
