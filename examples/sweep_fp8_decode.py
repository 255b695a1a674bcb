"""Sweep decode-attention tile configs for bf16 and fp8 (e4m3) KV caches on one CUDA GPU (issue 16).

Shapes: Qwen3-0.6B attention (16 query / 8 KV heads, head_dim 128, block_size 16), batch 64/128/256,
context 512/2048/8192, one decode token per sequence. For each (KV dtype, batch, context) every candidate
config (TILE_N, num_warps, num_stages, context splits) is timed by replaying a CUDA graph of calls that rotate
over disjoint copies of the inputs (so small problems are not served from L2; median over replays), and its
output is compared with the default config's (the default itself with a float64 reference on two sequences):
a config that fails to compile, runs out of shared memory or gives a wrong answer is reported and never
picked. GB/s counts the K/V bytes read. Where the kernel has the ``FP8_DOT_F16`` switch, fp8 shapes also
time the previous fp8 path (K/V upcast to bf16 instead of fp16) for the default and the best configs.

    PYTHONUNBUFFERED=1 python examples/sweep_fp8_decode.py --out DIR      # H100: ~3 min
    python examples/sweep_fp8_decode.py --smoke --out /tmp/sweep          # CPU, Triton interpreter, tiny

Writes DIR/sweep_fp8_decode.json (rewritten after every shape, so a cut-off run keeps what it measured) and
DIR/sweep_fp8_decode.txt (the table also printed at the end).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:  # CPU run: kernels in Triton's interpreter (must be set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from hfpaged.kernels import paged_attention_reference  # noqa: E402
from hfpaged.kernels.attention_config import AttentionConfig, choose_config  # noqa: E402

pa_module = importlib.import_module("hfpaged.kernels.paged_attention")
launch_module = importlib.import_module("hfpaged.kernels.attention_launch")  # where the kernel is launched
paged_attention_with_config = pa_module.paged_attention_with_config

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn
FP8_SCALE = 1.0 / 64  # cache value = x / scale: randn x 64 fits e4m3 (+-448) with room
L2_ROTATE_BYTES = 256 << 20  # rotate input sets until one pass reads at least this much
KV_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "e4m3"}
MAX_REL_DIFF = 2e-2  # max |candidate - default| / max |default|: a broken config is far above this

# Candidate decode configs (BLOCK_M is 16 rows for 2 query heads per KV head): (TILE_N, num_warps, num_stages).
TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
         (256, 4, 2), (256, 8, 2)]  # fmt: skip
SPLIT_TILES = [(64, 4, 2), (128, 4, 2), (128, 8, 2)]  # also tried with 2 context splits at the smallest batch
SMOKE_TILES = [(32, 4, 2)]  # with 2 context splits: exercises the split path and merge


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- the fp8 dot dtype switch (kernel constexpr FP8_DOT_F16, when it exists) ----------------------------


class _KernelWithFlag:
    """Stands in for ``_paged_attention_kernel`` in attention_launch.py: launches it with FP8_DOT_F16 set."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.fp8_dot_f16 = None  # None: the kernel's default

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        if self.fp8_dot_f16 is None:
            return launch
        flag = self.fp8_dot_f16
        return lambda *args, **kwargs: launch(*args, FP8_DOT_F16=flag, **kwargs)


KERNEL = _KernelWithFlag(launch_module._paged_attention_kernel)
HAS_FP8_DOT_SWITCH = "FP8_DOT_F16" in getattr(KERNEL.kernel, "arg_names", ())
if HAS_FP8_DOT_SWITCH:
    launch_module._paged_attention_kernel = KERNEL


# ---- timing ------------------------------------------------------------------------------------------


def graph_time_ms(calls, device: str, target_ms: float = 2.0, replays: int = 10) -> float:
    """Median ms per call, replaying a CUDA graph that runs ``calls`` round-robin (host clock on the CPU)."""
    for call in calls:  # compiles; errors (shared memory, compile) surface here, outside any capture
        call()
    if device != "cuda":
        t = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import graph_time_ms as replay_time_ms  # the kernel benchmark's graph-replay timing

    return replay_time_ms(calls, target_ms=target_ms, replays=replays)


# ---- problems ----------------------------------------------------------------------------------------


class DecodeProblem:
    """``batch`` sequences of ``context`` tokens, one query each, over a shuffled block pool in ``sets`` copies."""

    def __init__(self, batch: int, context: int, kv_dtype: torch.dtype, q_dtype: torch.dtype, device: str):
        self.batch, self.context, self.kv_dtype, self.device = batch, context, kv_dtype, device
        self.fp8 = kv_dtype == FP8
        self.kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * kv_dtype.itemsize
        self.sets = 1 if device != "cuda" else max(1, min(64, math.ceil(L2_ROTATE_BYTES / self.kv_bytes)))
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq * self.sets
        shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        caches = []
        for _ in range(2):
            if self.fp8:
                cache = torch.empty(shape, device=device, dtype=FP8)
                for chunk in cache.split(max(1, (256 << 20) // (BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM))):
                    x = torch.randn(chunk.shape, device=device, dtype=torch.bfloat16) / FP8_SCALE
                    chunk.copy_(x.float().clamp(-448, 448).to(FP8))  # bounded temporary memory
                caches.append(cache)
            else:
                caches.append(torch.randn(shape, device=device, dtype=kv_dtype))
        self.k_cache, self.v_cache = caches
        self.k_scale = torch.full((1,), FP8_SCALE, device=device, dtype=torch.float32) if self.fp8 else None
        self.v_scale = self.k_scale
        perm = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
        self.tables = list(perm.view(self.sets, batch, blocks_per_seq).unbind(0))
        self.qs = [torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=q_dtype) for _ in range(self.sets)]
        self.seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        self.cu = torch.arange(batch + 1, device=device, dtype=torch.int32)

    def call(self, config: AttentionConfig, i: int = 0):
        args = (self.qs[i], self.k_cache, self.v_cache, self.tables[i], self.seq_lens, self.cu)
        return lambda: paged_attention_with_config(
            *args, scale=HEAD_DIM**-0.5, config=config, k_scale=self.k_scale, v_scale=self.v_scale
        )

    def default_config(self) -> AttentionConfig:
        return choose_config(
            num_tokens=self.batch, num_seqs=self.batch, num_kv_heads=NUM_KV_HEADS, group=NUM_HEADS // NUM_KV_HEADS,
            head_dim_pad=HEAD_DIM, elem_size=self.qs[0].element_size(), max_seqlen_q=1, max_seqlen_k=self.context,
            device=torch.device(self.device),
        )  # fmt: skip

    def reference_rel_diff(self, out: torch.Tensor, num_seqs: int = 2) -> float:
        """Max |out - float64 reference| / max |reference| over the first ``num_seqs`` sequences of set 0."""
        ref = paged_attention_reference(
            self.qs[0][:num_seqs].double(), self.k_cache, self.v_cache, self.tables[0][:num_seqs],
            self.seq_lens[:num_seqs], self.cu[: num_seqs + 1], scale=HEAD_DIM**-0.5, k_scale=self.k_scale,
            v_scale=self.v_scale,
        )  # fmt: skip
        return rel_diff(out[:num_seqs], ref)


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def short(config: AttentionConfig, dot: str | None = None) -> str:
    text = f"n{config.tile_n}/w{config.num_warps}/s{config.num_stages}/x{config.num_splits}"
    return text + (f"/{dot}" if dot else "")


# ---- sweep -------------------------------------------------------------------------------------------


def measure(problem: DecodeProblem, config: AttentionConfig, reference_out, fp8_dot_f16=None) -> dict:
    """Time one config and check its output against ``reference_out``; a failure is recorded, not raised."""
    row = dict(vars(config), fp8_dot=None if fp8_dot_f16 is None else ("f16" if fp8_dot_f16 else "bf16"))
    KERNEL.fp8_dot_f16 = fp8_dot_f16
    try:
        out = problem.call(config)()
        row["rel_diff_vs_default"] = rel_diff(out, reference_out) if reference_out is not None else 0.0
        if not row["rel_diff_vs_default"] <= MAX_REL_DIFF:
            row["skipped"] = f"wrong output: rel diff {row['rel_diff_vs_default']:.3g} vs the default config"
            return row
        ms = graph_time_ms([problem.call(config, i) for i in range(problem.sets)], problem.device)
        row.update(us=ms * 1e3, gbs=problem.kv_bytes / ms / 1e6)
    except Exception as exc:  # out of shared memory / registers, compile error: report, never pick
        row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        KERNEL.fp8_dot_f16 = None
    return row


def candidates(problem: DecodeProblem, default: AttentionConfig, smoke: bool) -> list[AttentionConfig]:
    if smoke:
        return [default] + [AttentionConfig(16, n, w, s, 2) for n, w, s in SMOKE_TILES]
    configs = [default] + [AttentionConfig(16, n, w, s, default.num_splits) for n, w, s in TILES]
    if problem.batch == min(BATCHES) and problem.context >= 2048:
        configs += [AttentionConfig(16, n, w, s, 2) for n, w, s in SPLIT_TILES]
    unique = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


def sweep_shape(problem: DecodeProblem, smoke: bool, deadline: float, best_so_far: list[AttentionConfig]) -> dict:
    default = problem.default_config()
    result = dict(kv_dtype=str(problem.kv_dtype).replace("torch.", ""), q_dtype=str(problem.qs[0].dtype),
                  batch=problem.batch, context=problem.context, kv_bytes=problem.kv_bytes, sets=problem.sets,
                  default=vars(default), rows=[])  # fmt: skip
    default_out = problem.call(default)()
    try:
        result["default_rel_diff_vs_float64"] = problem.reference_rel_diff(default_out)
    except Exception as exc:  # the reference check is a guard, not the point: report and go on
        result["default_rel_diff_vs_float64"] = float("nan")
        log(f"  reference check failed: {type(exc).__name__}: {str(exc)[:160]}")
    if result["default_rel_diff_vs_float64"] > MAX_REL_DIFF:
        log(f"  WARNING: the default config differs from the float64 reference by "
            f"{result['default_rel_diff_vs_float64']:.3g} (relative)")  # fmt: skip
    configs = candidates(problem, default, smoke)
    if time.monotonic() > deadline:  # out of time: only configs that are compiled already
        configs = [c for c in configs if c == default or c in best_so_far]
        result["truncated"] = "time budget spent: default and earlier winners only"
    for config in configs:
        row = measure(problem, config, default_out)
        row["is_default"] = config == default
        result["rows"].append(row)
        log(f"  {short(config):22s} " + (f"skipped: {row['skipped']}" if "skipped" in row else
            f"{row['us']:9.1f} us {row['gbs']:7.0f} GB/s  diff {row['rel_diff_vs_default']:.1e}"))  # fmt: skip
    ok = sorted((r for r in result["rows"] if "us" in r), key=lambda r: r["us"])
    if problem.fp8 and HAS_FP8_DOT_SWITCH:  # the previous fp8 path (K/V upcast to bf16): default + 2 best configs
        previous = [default] + [AttentionConfig(**{k: r[k] for k in vars(default)}) for r in ok[:2]]
        for config in dict.fromkeys(previous):
            row = measure(problem, config, default_out, fp8_dot_f16=False)
            row["is_default"] = config == default
            result["rows"].append(row)
            log(f"  {short(config, 'bf16-dot'):22s} " + (f"skipped: {row['skipped']}" if "skipped" in row else
                f"{row['us']:9.1f} us {row['gbs']:7.0f} GB/s  diff {row['rel_diff_vs_default']:.1e}"))  # fmt: skip
        ok = sorted((r for r in result["rows"] if "us" in r), key=lambda r: r["us"])
    default_row = next((r for r in result["rows"] if r["is_default"] and r["fp8_dot"] is None and "us" in r), None)
    result["best"] = ok[0] if ok else None
    result["default_us"] = default_row["us"] if default_row else None
    if ok and default_row:
        result["best_speedup_vs_default"] = default_row["us"] / ok[0]["us"]
    return result


def table(results: list[dict]) -> str:
    lines = [
        f"{'kv':>6} {'B':>4} {'ctx':>5} | {'default config':>20} {'us':>8} {'GB/s':>6} | "
        f"{'best config':>27} {'us':>8} {'GB/s':>6} {'x':>5}",
    ]
    for r in results:
        d = AttentionConfig(**r["default"])
        best = r.get("best")
        du = r.get("default_us")
        dg = r["kv_bytes"] / du / 1e3 if du else float("nan")
        if best:
            bc = AttentionConfig(**{k: best[k] for k in r["default"]})
            bdesc = short(bc, best["fp8_dot"] and f"{best['fp8_dot']}-dot")
            lines.append(f"{KV_NAMES.get(r['kv_dtype'], r['kv_dtype']):>6} {r['batch']:4d} {r['context']:5d} | {short(d):>20} "
                         f"{du or float('nan'):8.1f} {dg:6.0f} | {bdesc:>27} {best['us']:8.1f} {best['gbs']:6.0f} "
                         f"{r.get('best_speedup_vs_default', float('nan')):5.2f}")  # fmt: skip
        else:
            lines.append(
                f"{KV_NAMES.get(r['kv_dtype'], r['kv_dtype']):>6} {r['batch']:4d} {r['context']:5d} | no config ran"
            )
    # Per (batch, context): fp8 time / 16-bit-cache time, defaults and bests (0.50 = proportional to bytes).
    sixteen = {(r["batch"], r["context"]): r for r in results if not r["kv_dtype"].startswith("float8")}
    ratios = []
    for r in results:
        other = sixteen.get((r["batch"], r["context"]))
        if r["kv_dtype"].startswith("float8") and other and r.get("default_us") and other.get("default_us"):
            best = r["best"]["us"] / other["best"]["us"] if r.get("best") and other.get("best") else float("nan")
            ratios.append(f"  B={r['batch']:4d} ctx={r['context']:5d}: defaults {r['default_us'] / other['default_us']:.2f}, "
                          f"bests {best:.2f}")  # fmt: skip
    if ratios:
        lines += ["fp8 time per call / 16-bit cache time per call (0.50 = proportional to bytes):"] + ratios
    return "\n".join(lines)


BATCHES = (64, 128, 256)
CONTEXTS = (512, 2048, 8192)


def main(argv=None) -> None:
    global BATCHES, CONTEXTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for sweep_fp8_decode.json / .txt")
    parser.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), tiny shapes, 2 configs")
    parser.add_argument("--budget-s", type=float, default=210.0,
                        help="after this many seconds, remaining shapes time only compiled configs")  # fmt: skip
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.budget_s
    if args.smoke:
        device, q_dtype, kv_dtypes = "cpu", torch.float16, (FP8, torch.float16)
        BATCHES, CONTEXTS = (2, 3), (48,)
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke for the CPU interpreter)")
        device, q_dtype, kv_dtypes = "cuda", torch.bfloat16, (FP8, torch.bfloat16)  # fp8 first: the point
        log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {importlib.import_module('triton').__version__}, fp8 dot switch in kernel: {HAS_FP8_DOT_SWITCH}")  # fmt: skip
    json_path = os.path.join(args.out, "sweep_fp8_decode.json")
    meta = dict(shape=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                torch=torch.__version__, fp8_dot_switch=HAS_FP8_DOT_SWITCH, fp8_scale=FP8_SCALE, smoke=args.smoke)  # fmt: skip
    results: list[dict] = []
    best_so_far: dict[str, list[AttentionConfig]] = {}
    for kv_dtype in kv_dtypes:
        for context in CONTEXTS:
            for batch in BATCHES:
                name = str(kv_dtype).replace("torch.", "")
                log(f"[{time.monotonic() - start:6.1f} s] kv {name} B={batch} ctx={context}")
                try:
                    problem = DecodeProblem(batch, context, kv_dtype, q_dtype, device)
                    result = sweep_shape(problem, args.smoke, deadline, best_so_far.setdefault(name, []))
                except Exception as exc:  # a whole shape failing (e.g. memory) must not end the sweep
                    traceback.print_exc()
                    result = dict(kv_dtype=name, batch=batch, context=context, error=f"{type(exc).__name__}: {exc}")
                    log(f"  shape failed: {result['error'][:200]}")
                problem = None
                if device == "cuda":
                    torch.cuda.empty_cache()
                results.append(result)
                best = result.get("best")
                if best:
                    config = AttentionConfig(**{k: best[k] for k in result["default"]})
                    if config not in best_so_far[name]:
                        best_so_far[name].append(config)
                    log(f"  -> best {short(config, best['fp8_dot'])} {best['us']:.1f} us {best['gbs']:.0f} GB/s, "
                        f"default {result.get('default_us') or float('nan'):.1f} us")  # fmt: skip
                with open(json_path, "w") as f:
                    json.dump(dict(meta, elapsed_s=time.monotonic() - start, results=results), f, indent=1)
    text = table([r for r in results if "error" not in r])
    log("\n" + text)
    with open(os.path.join(args.out, "sweep_fp8_decode.txt"), "w") as f:
        f.write(text + "\n")
    log(f"done in {time.monotonic() - start:.0f} s; wrote {json_path}")


if __name__ == "__main__":
    main()
