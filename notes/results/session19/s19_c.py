"""Probe C (session 19): batch-1 projections as Triton GEMVs that load their weights before the dependent-launch wait.

python notes/results/session19/s19_c.py OUT.json [--dry-run]
A model-length chain of layer skeletons at one row, in one CUDA graph: E(norm) -> G(qkv) -> E(stand-in for RoPE and
attention) -> G(o) -> E(residual + norm) -> G(gate/up) -> E(activation) -> G(down), E a one-program normalising
kernel with dependent launch (waits, then signals after its loads, as Inductor's kernels do). G is cuBLAS
(F.linear), a Triton GEMV, or the same GEMV with dependent launch that loads its whole weight slice before it waits
(weights are no step's output) and signals at once; "early": the E kernels also signal before their wait.
"none": the E kernels alone. Qwen3-0.6B and Llama-3.2-1B dimensions, bf16, random weights. Prints us per layer per variant.
"""

import json
import sys
import time

sys.path.insert(0, "examples")
import bench_kernels as bk  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hfpaged.kernels.gemv import _gemv_kernel, linear_few_rows  # noqa: E402

DRY = "--dry-run" in sys.argv
bk.DEVICE = DEV = "cpu" if DRY else "cuda"
DT = torch.float16 if DRY else torch.bfloat16
SMALL_BYTES = 64 << 20  # product_pdl_small: cuBLAS above this weight size
REGS_ELEMS = 32768  # weight elements per program held in registers (8 warps: 128 per thread)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
          USE_PDL: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, K_PAD)
    n_ok = offs_n < N
    k_ok = offs_k < K
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _norm(x_ptr, y_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr):
    if USE_PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if USE_PDL:
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()
    r = tl.rsqrt(tl.sum(x * x, 0) / n + 1e-6)
    tl.store(y_ptr + offs, (x * r).to(y_ptr.dtype.element_ty), mask=offs < n)


def pdl_kw(on):
    return {"launch_pdl": True} if on and not DRY else {}


def gemv(x, w, y, pdl):
    n, k = w.shape
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, min(REGS_ELEMS // k_pad, triton.next_power_of_2(max(1, n // 128))))
    _gemv[(triton.cdiv(n, block_n),)](x, w, y, n, K=k, K_PAD=k_pad, BLOCK_N=block_n, USE_PDL=pdl and not DRY,
                                      num_warps=8, **pdl_kw(pdl))  # fmt: skip


def norm(x, y, n, pdl, early):
    _norm[(1,)](x, y, n, BLOCK=triton.next_power_of_2(n), USE_PDL=pdl and not DRY, EARLY=early, num_warps=4,
                **pdl_kw(pdl))  # fmt: skip


def _product(x, w, y, rows, pdl, regs=None, warps=None, wave_regs=None):
    """The kernel of kernels/gemv.py; ``regs``/``warps``: another register budget / warp count (sweep), and
    ``wave_regs``: that budget only for weights that do not fit one wave at the default budget."""
    from hfpaged.kernels import gemv as gk

    n, k = w.shape
    k_pad = triton.next_power_of_2(k)
    budget, nwarps = regs or gk.REGISTER_ELEMENTS, warps or gk.GEMV_NUM_WARPS
    sms = torch.cuda.get_device_properties(0).multi_processor_count if not DRY else 4
    if wave_regs is not None:
        one_wave = n * k_pad <= gk.REGISTER_ELEMENTS * sms
        budget = gk.REGISTER_ELEMENTS if one_wave else wave_regs
    per_sm = triton.next_power_of_2(max(1, n // sms))
    block_n = max(1, min(budget // k_pad, per_sm))
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, w, y, n, k, k, n, ROWS=rows, K=k, K_PAD=k_pad,
                                             BLOCK_N=block_n, HAS_BIAS=False, USE_PDL=pdl and not DRY,
                                             num_warps=nwarps, **pdl_kw(pdl))  # fmt: skip


def build(hidden, q, kv, inter, layers):
    g = torch.Generator(device=DEV).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).to(DT)

    ws = [dict(qkv=w(q + 2 * kv, hidden), o=w(hidden, q), gu=w(2 * inter, hidden), d=w(hidden, inter))
          for _ in range(layers)]  # fmt: skip
    bufs = {name: torch.zeros(4 * size, device=DEV, dtype=DT)
            for name, size in (("x", hidden), ("h", hidden), ("qkv", q + 2 * kv), ("r", q), ("o", hidden),
                               ("h2", hidden), ("gu", 2 * inter), ("a", inter))}  # fmt: skip
    bufs["x"].copy_(torch.randn(4 * hidden, device=DEV, generator=g).to(DT))
    return ws, bufs, dict(hidden=hidden, q=q, inter=inter)


def chain(ws, b, d, mode, rows=1):
    cublas = mode == "cublas"
    pdl = mode in ("triton_pdl", "triton_pdl_early")
    early = mode == "triton_pdl_early"

    def G(x, w, y):
        if mode == "none":
            return
        if cublas or (mode == "product_pdl_small" and w.numel() * w.element_size() > SMALL_BYTES):
            torch.mm(x.view(4, -1)[:rows], w.t(), out=y.view(4, -1)[:rows])
        elif mode.startswith("sweep"):  # sweep:REGS:WARPS or sweep:wave:REGS:WARPS, with dependent launch
            parts = mode.split(":")
            if parts[1] == "wave":
                _product(x, w, y, rows, True, warps=int(parts[3]), wave_regs=int(parts[2]))
            else:
                _product(x, w, y, rows, True, regs=int(parts[1]), warps=int(parts[2]))
        elif mode.startswith("product"):  # kernels/gemv.py: signals after its wait
            _product(x, w, y, rows, mode == "product_pdl")
        else:
            gemv(x, w, y, pdl)

    def run():
        for lw in ws:
            norm(b["x"], b["h"], d["hidden"], True, early)
            G(b["h"], lw["qkv"], b["qkv"])
            norm(b["qkv"], b["r"], d["q"], True, early)
            G(b["r"], lw["o"], b["o"])
            norm(b["o"], b["h2"], d["hidden"], True, early)
            G(b["h2"], lw["gu"], b["gu"])
            norm(b["gu"], b["a"], d["inter"], True, early)
            G(b["a"], lw["d"], b["x"])

    return run


def main():
    out_path = sys.argv[1]
    rows = []
    t0 = time.time()
    shapes = {"qwen3-0.6b": (1024, 2048, 1024, 3072, 28), "llama-3.2-1b": (2048, 2048, 512, 8192, 16),
              "llama-3.1-8b": (4096, 4096, 1024, 14336, 32)}
    if "--only" in sys.argv:
        shapes = {k: v for k, v in shapes.items() if k in sys.argv[sys.argv.index("--only") + 1].split(",")}
    if DRY:
        shapes = {"tiny": (64, 64, 32, 128, 2)}
    modes = ["none", "cublas", "triton", "product", "product_pdl", "product_pdl_small", "triton_pdl", "triton_pdl_early"]
    if "--modes" in sys.argv:
        modes = sys.argv[sys.argv.index("--modes") + 1].split(",")
    for name, (hidden, q, kv, inter, layers) in shapes.items():
        ws, b, d = build(hidden, q, kv, inter, layers)
        # check the GEMV against cuBLAS on one projection of each shape
        for key, x in (("qkv", b["h"]), ("o", b["r"]), ("gu", b["h2"]), ("d", b["a"])):
            x.copy_(torch.randn_like(x, dtype=torch.float32).to(DT))
            xr = x.view(4, -1)[:, : ws[0][key].shape[1]].contiguous()
            ref = xr.float() @ ws[0][key].float().t()
            y = torch.cat([linear_few_rows(xr[i : i + 1], ws[0][key]) for i in range(4)])
            rows.append(dict(model=name, check=key, max_abs=float((y.float() - ref).abs().max()),
                             ref_max=float(ref.abs().max())))  # fmt: skip
            print(f"{name} {key}: max |triton - fp32 ref| {rows[-1]['max_abs']:.3g} (ref max {rows[-1]['ref_max']:.3g})")
        weight_bytes = sum(t.numel() * t.element_size() for lw in ws for t in lw.values())
        for rep in range(2 if not DRY else 1):
            for nrows in (1,):
                for mode in modes if nrows == 1 else ["cublas", "product_pdl"]:
                    ms = bk.graph_time_ms([chain(ws, b, d, mode, nrows)], target_ms=20, replays=10)
                    row = dict(model=name, mode=mode, rows=nrows, rep=rep, us_per_token=ms * 1e3,
                               us_per_layer=ms * 1e3 / layers, weight_tbs=weight_bytes / ms / 1e9)  # fmt: skip
                    rows.append(row)
                    print(f"{name} rows {nrows} {mode:17s} rep {rep}: {ms * 1e3:8.1f} us per chain, "
                          f"{row['us_per_layer']:6.2f} us per layer, weights at {row['weight_tbs']:.2f} TB/s",
                          flush=True)  # fmt: skip
        del ws, b
    kernels = []
    if not DRY:
        for caches in _gemv_kernel.device_caches.values():
            for kernel in caches[0].values():
                kernels.append(dict(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared))
        print("product kernels:", kernels)
    json.dump(dict(rows=rows, kernels=kernels, elapsed_s=time.time() - t0), open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
