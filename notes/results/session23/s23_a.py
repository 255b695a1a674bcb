"""Probe A (session 23): (1) prompt tiles of large mixed steps, (2) the GEMMs of a batch-256 decode step.

python notes/results/session23/s23_a.py [--dry-run] [--out DIR]

(1) paged_attention over mixed batches shaped like the engine's mixed graphs (Qwen3-0.6B heads 16/8 x 128, bf16,
block 16; every batch padded to its token bucket with one padding sequence storing nothing, as InputBatch.pack
does), the step's K/V stored and passed in as the engine passes them, each tile config forced through
``choose_config``; CUDA-graph timing (bench_kernels.graph_time_ms); each output compared with the default config's.
(2) The decode step's GEMMs at M = 256 / 128 rows (Qwen3-0.6B: qkv, o, gate_up, down, 28 layers of distinct
weights, then the LM head) timed in one graph, cuBLAS (default and cuBLASLt) and a plain Triton GEMM.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, "examples")
from bench_kernels import graph_time_ms as replay_time_ms  # noqa: E402

from hfpaged.kernels.attention_config import AttentionConfig  # noqa: E402
from hfpaged.kernels.dependent_launch import dependent_launch_supported  # noqa: E402

pa = importlib.import_module("hfpaged.kernels.paged_attention")
DEVICE = "cpu" if DRY else "cuda"
H, KVH, HD, BS = (4, 2, 32, 16) if DRY else (16, 8, 128, 16)
if "--heads" in sys.argv:  # e.g. 32,8,64 (Llama-3.2-1B), 32,8,128 (Llama-3.1-8B)
    H, KVH, HD = (int(x) for x in sys.argv[sys.argv.index("--heads") + 1].split(","))
DTYPE = torch.float16 if DRY else torch.bfloat16
FP8 = "--fp8" in sys.argv  # e4m3 caches (scale 1/64), bf16 queries
FEW = "--few-configs" in sys.argv
OUT = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else os.environ.get("OUT", "/tmp")


def log(msg):
    print(msg, flush=True)


def time_ms(calls):
    if DRY:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    return replay_time_ms(calls, target_ms=5.0, replays=15)


# ---- (1) mixed steps -------------------------------------------------------------------------------------------


class Mixed:
    """Sequences (q_len, seq_len) packed as the engine packs a step, padded to ``bucket`` tokens."""

    def __init__(self, seqs, bucket, sets):
        real = sum(q for q, _ in seqs)
        assert real <= bucket, (real, bucket)
        if bucket > real:
            seqs = seqs + [(bucket - real, bucket - real)]  # the padding sequence: stores nothing
        self.pad = bucket > real
        self.seqs, self.T = seqs, bucket
        self.real = real
        self.max_q = max(q for q, _ in seqs[: len(seqs) - self.pad] or seqs)
        blocks = [math.ceil(s / BS) for _, s in seqs]
        width = max(blocks)
        nblocks = sum(blocks) * sets + 1
        self.k_cache = torch.randn(nblocks, BS, KVH, HD, device=DEVICE, dtype=DTYPE)
        self.v_cache = torch.randn(nblocks, BS, KVH, HD, device=DEVICE, dtype=DTYPE)
        self.scales = {}
        if FP8:
            scale = torch.full((1,), 1 / 64, device=DEVICE, dtype=torch.float32)
            self.k_cache = (self.k_cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            self.v_cache = (self.v_cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            self.scales = {"k_scale": scale, "v_scale": scale}
        perm = torch.randperm(nblocks - 1) + 1
        self.sets = []
        at = 0
        for _ in range(sets):
            tables = torch.zeros(len(seqs), width, dtype=torch.int32)
            slots = []
            for i, ((q, s), nb) in enumerate(zip(seqs, blocks)):
                tables[i, :nb] = perm[at : at + nb].to(torch.int32)
                at += nb
                if self.pad and i == len(seqs) - 1:
                    tables[i] = 0
                    slots += [-1] * q
                else:
                    pos = torch.arange(s - q, s)
                    slots += (tables[i, pos // BS].long() * BS + pos % BS).tolist()
            q = torch.randn(bucket, H, HD, device=DEVICE, dtype=DTYPE)
            k = torch.randn(bucket, KVH, HD, device=DEVICE, dtype=DTYPE)
            v = torch.randn(bucket, KVH, HD, device=DEVICE, dtype=DTYPE)
            self.sets.append((q, k, v, tables.to(DEVICE), torch.tensor(slots, dtype=torch.int64, device=DEVICE)))
        self.seq_lens = torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE)
        cu = [0]
        for q, _ in seqs:
            cu.append(cu[-1] + q)
        self.cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
        self.max_k = width * BS
        # causal attention FLOPs of the real rows (QK and PV, 2 FLOPs per MAC)
        self.flops = sum(4 * H * HD * (q * (s - q) + q * (q + 1) / 2) for q, s in seqs[: len(seqs) - self.pad])

    def call(self, hint, i=0):
        q, k, v, tables, slots = self.sets[i]
        pdl = (not DRY) and dependent_launch_supported(q.device)
        return lambda: pa.paged_attention(
            q, self.k_cache, self.v_cache, tables, self.seq_lens, self.cu, scale=HD**-0.5, max_seqlen_q=hint,
            max_seqlen_k=self.max_k, key=k, value=v, slot_mapping=slots, launch_pdl=pdl, **self.scales,
        )  # fmt: skip


FORCED = [None]
_choose = pa.choose_config


def _forced_choose(**kw):
    return FORCED[0] if FORCED[0] is not None else _choose(**kw)


pa.choose_config = _forced_choose


def scenarios(rng):
    U = rng.randint
    out = {}
    if DRY:
        return {"tiny": ([(1, 40), (1, 70)] + [(n, n) for n in (U(8, 40) for _ in range(3))], 160)}

    def fill(decode, lo, hi, bucket, ctx=(300, 600)):
        seqs = [(1, U(*ctx)) for _ in range(decode)]
        total = decode
        while True:
            n = U(lo, hi)
            if total + n > bucket:
                break
            seqs.append((n, 0))
            total += n
        return [(q, s if q == 1 else q) for q, s in seqs]

    out["chat 1 decode + prompts 32-512"] = (fill(1, 32, 512, 8192), 8192)
    out["chat 212 decode + prompts 32-512"] = (fill(212, 32, 512, 8192), 8192)
    out["chat 240 decode + prompts 32-512 (6144)"] = (fill(240, 32, 512, 6144), 6144)
    out["nano 100 decode (ctx 200-1500) + prompts 100-1024"] = (fill(100, 100, 1024, 8192, (200, 1500)), 8192)
    out["nano 0 decode + prompts 100-1024"] = (fill(0, 100, 1024, 8192), 8192)
    out["prompts 1000-1500 (4096)"] = (fill(0, 1000, 1500, 4096), 4096)
    out["2 prompts 4096"] = ([(4096, 4096), (4096, 4096)], 8192)
    out["chunk 2048 after 6000 + chunk 2048 after 2000"] = ([(2048, 8048), (2048, 4048)], 4096)
    return out


def tile_configs():
    if DRY:
        return [(64, 32, 4, 2), (128, 32, 4, 3)]
    if FEW:
        return [(128, 128, 8, 3), (128, 32, 4, 3), (64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2)]
    return [
        (128, 128, 8, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 2), (128, 64, 4, 2),
        (64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (64, 128, 4, 3), (128, 128, 4, 3),
    ]  # fmt: skip


def attention_part(results):
    rng = random.Random(23)
    for name, (seqs, bucket) in scenarios(rng).items():
        prob = Mixed(seqs, bucket, sets=1 if DRY else 4)
        rows = {}
        FORCED[0] = None
        ref = prob.call(bucket)()[: prob.real].float()
        base = None
        for label, hint, cfg in [("default hint=T", bucket, None), ("default hint=1536", min(bucket, 1536), None)] + [
            (f"m{m}/n{n}/w{w}/s{s}", bucket, AttentionConfig(m, n, w, s)) for m, n, w, s in tile_configs()
        ]:
            FORCED[0] = cfg
            try:
                out = prob.call(hint)()[: prob.real].float()
                diff = ((out - ref).abs().max() / ref.abs().max()).item()
                ms = time_ms([prob.call(hint, i) for i in range(len(prob.sets))])
            except Exception as e:  # noqa: BLE001
                rows[label] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                log(f"  {name:52} {label:22} ERROR {rows[label]['error']}")
                continue
            finally:
                FORCED[0] = None
            base = base or ms
            rows[label] = {"ms": ms, "tflops": prob.flops / ms / 1e9, "rel_diff": diff}
            log(f"  {name:52} {label:22} {ms:8.3f} ms  {prob.flops / ms / 1e9:6.1f} TFLOP/s  x{base / ms:5.2f}  "
                f"diff {diff:.1e}")  # fmt: skip
        n_dec = sum(1 for q, _ in seqs if q == 1)
        results[name] = {"bucket": bucket, "real_tokens": sum(q for q, _ in seqs), "decode_rows": n_dec,
                         "max_q": prob.max_q, "rows": rows}  # fmt: skip
        del prob
        if not DRY:
            torch.cuda.empty_cache()


# ---- (2) decode-step GEMMs ---------------------------------------------------------------------------------------


@triton.jit
def _mm_kernel(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group_id = pid // (GROUP * num_m)
    first_n = group_id * GROUP
    gsz = min(num_n - first_n, GROUP)
    pid_n = first_n + (pid % (GROUP * num_m)) % gsz
    pid_m = (pid % (GROUP * num_m)) // gsz
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + rm[:, None] * sam + (k0 + rk)[None, :] * sak, mask=rm[:, None] < M, other=0.0)
        w = tl.load(b + (k0 + rk)[:, None] * sbk + rn[None, :] * sbn, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_mm(x, w_t, out, cfg):
    """out = x @ w_t.T (w_t: [N, K] like nn.Linear's weight)."""
    M, K = x.shape
    N = w_t.shape[0]
    bm, bn, bk, warps, stages = cfg
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _mm_kernel[grid](x, w_t, out, M, N, K, x.stride(0), x.stride(1), w_t.stride(1), w_t.stride(0), out.stride(0),
                     out.stride(1), BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def gemm_part(results):
    hidden, inter, qkv, o_in, vocab, layers = (
        (64, 128, 128, 64, 1000, 2) if DRY else (1024, 3072, 4096, 2048, 151936, 28)
    )
    shapes = {"qkv": (hidden, qkv), "o": (o_in, hidden), "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    weights = {k: [torch.randn(n, kk, device=DEVICE, dtype=DTYPE) * 0.02 for _ in range(layers)] for k, (kk, n) in shapes.items()}
    lm = torch.randn(vocab, hidden, device=DEVICE, dtype=DTYPE) * 0.02
    peak_bw = 3.0e12
    for M in ([16] if DRY else [256, 128]):
        xs = {k: torch.randn(M, kk, device=DEVICE, dtype=DTYPE) for k, (kk, n) in shapes.items()}
        outs = {k: torch.empty(M, n, device=DEVICE, dtype=DTYPE) for k, (kk, n) in shapes.items()}
        xl, ol = torch.randn(M, hidden, device=DEVICE, dtype=DTYPE), torch.empty(M, vocab, device=DEVICE, dtype=DTYPE)
        res = {}
        libs = ["default"] if DRY else ["default", "cublaslt"]
        for lib in libs:
            if not DRY:
                torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
            for k in shapes:
                ms = time_ms([lambda k=k, i=i: torch.mm(xs[k], weights[k][i].t(), out=outs[k]) for i in range(layers)])
                res[f"{lib} {k}"] = ms * 1e3
            res[f"{lib} lm_head"] = time_ms([lambda: torch.mm(xl, lm.t(), out=ol)]) * 1e3
            layer_calls = [lambda k=k, i=i: torch.mm(xs[k], weights[k][i].t(), out=outs[k]) for i in range(layers) for k in shapes]
            res[f"{lib} 28 layers + lm_head"] = time_ms([lambda: [c() for c in layer_calls] and None, lambda: torch.mm(xl, lm.t(), out=ol)]) * 2e3
        if not DRY:
            torch.backends.cuda.preferred_blas_library("cublas")
        cfgs = [(64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 32, 128, 4, 4),
                (128, 32, 64, 4, 4), (64, 64, 128, 4, 3), (128, 64, 128, 8, 3), (64, 128, 128, 8, 3), (256, 64, 64, 8, 3)]
        if DRY:
            cfgs = [(16, 32, 32, 4, 2)]
        for k in list(shapes) + ["lm_head"]:
            best = None
            for cfg in cfgs:
                try:
                    if k == "lm_head":
                        ref = torch.mm(xl, lm.t()).float()
                        got = triton_mm(xl, lm, ol, cfg).float()
                        ms = time_ms([lambda cfg=cfg: triton_mm(xl, lm, ol, cfg)])
                    else:
                        ref = torch.mm(xs[k], weights[k][0].t()).float()
                        got = triton_mm(xs[k], weights[k][0], outs[k], cfg).float()
                        ms = time_ms([lambda cfg=cfg, i=i: triton_mm(xs[k], weights[k][i], outs[k], cfg) for i in range(layers)])
                    diff = ((got - ref).abs().max() / ref.abs().max()).item()
                except Exception as e:  # noqa: BLE001
                    log(f"  M={M} triton {k} {cfg} ERROR {type(e).__name__}: {str(e)[:150]}")
                    continue
                res[f"triton {k} {cfg}"] = ms * 1e3
                if diff > 2e-2:
                    log(f"  M={M} triton {k} {cfg} WRONG diff {diff:.2e}")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best:
                res[f"triton best {k}"] = [best[0] * 1e3, list(best[1])]
        ideal = {}
        for k, (kk, n) in list(shapes.items()) + [("lm_head", (hidden, vocab))]:
            byts = (n * kk + M * kk + M * n) * 2
            ideal[k] = max(byts / peak_bw, 2 * M * n * kk / 750e12) * 1e6
        res["ideal_us (max of 3.0 TB/s, 750 TFLOP/s)"] = ideal
        for key, val in res.items():
            log(f"  GEMM M={M} {key:40} {val if not isinstance(val, float) else f'{val:8.2f} us'}")
        results[f"M={M}"] = res


def main():
    results = {"attention": {}, "gemm": {}}
    if not DRY:
        log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    t = time.perf_counter()
    attention_part(results["attention"])
    log(f"attention part {time.perf_counter() - t:.0f} s")
    if "--attention-only" in sys.argv:
        results["heads"], results["fp8"] = [H, KVH, HD], FP8
        os.makedirs(OUT, exist_ok=True)
        tag = f"{H}_{KVH}_{HD}{'_fp8' if FP8 else ''}"
        with open(os.path.join(OUT, f"s23_a_{tag}.json"), "w") as f:
            json.dump(results, f, indent=1)
        return
    t = time.perf_counter()
    gemm_part(results["gemm"])
    log(f"gemm part {time.perf_counter() - t:.0f} s")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "s23_a.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
