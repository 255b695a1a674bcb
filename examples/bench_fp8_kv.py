"""FP8 vs bf16 KV cache, side by side in one process: max concurrent sequences and tokens/s (GPU).

    python examples/bench_fp8_kv.py --model qwen3-0.6b --pool-gib 8 --out bench_fp8

Random weights in a real shape (examples/benchmark.py's MODELS), bf16 weights, greedy, eos ignored.
Workloads, each run with kv_cache_dtype="auto" (bf16) and "fp8" (e4m3, calibrated scales):
  long       --long-requests prompts of U[4096, 8192] tokens, --long-new-tokens new tokens each, the pool
             limited to --pool-gib GiB (the pool is the limit)
  nano       the nano-vllm shape (256 requests, prompts and outputs ~U[100, 1024]), pool limited to
             --pool-gib GiB (the pool is the limit)
  nano_full  the nano-vllm shape with the pool sized by gpu_memory_utilization=0.9 (bf16 already holds
             every request: the pool is not the limit)
``--triton-decode`` adds a third run per workload, "fp8_triton": fp8 with the CUDA decode kernel switched off
(``hfpaged.kernels.fp8_decode``), so decode steps run the Triton kernel as before session 32. ``--old-splits`` adds
"fp8_old_splits": the CUDA kernel with the Triton kernel's context-split rule (as in session 32).
``--rows-together`` adds "fp8_rows_together": the decode rows of steps with prompt tokens inside the prompt launch
(``paged_attention.DECODE_ROWS_APART = "never"``, as before session 33).
``--repeats N`` times each workload N times per patch and reports the median run (all runs' tok/s kept).
Per run: wall time, output tokens/s, all tokens (prompt + output)/s, the most sequences running at once,
preemptions, pool blocks, and the wall time split between steps with prompt tokens and decode-only steps (each
step's time charged to the step launched before it, which it mostly waits on). Each patch is warmed up first
(Triton variants, CUDA graphs). Writes JSON (after every run) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchmark import MODELS, build_model, workload

import hfpaged
from hfpaged.kernels import attention_config, fp8_decode

paged_attention_module = sys.modules["hfpaged.kernels.paged_attention"]
CUDA_FP8_CTAS_PER_SM = attention_config.CUDA_FP8_CTAS_PER_SM
DECODE_ROWS_APART = paged_attention_module.DECODE_ROWS_APART


def long_workload(num_requests: int, new_tokens: int, vocab: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(4096, 8193, (num_requests,), generator=gen).tolist()
    prompts = [torch.randint(10, vocab - 10, (n,), generator=gen).tolist() for n in in_lens]
    return prompts, [new_tokens] * num_requests


def kv_bytes_per_token(model, kv: str) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = 1 if kv != "auto" else model.dtype.itemsize
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * elem


def run(model, prompts, out_lens) -> dict:
    engine = hfpaged.Engine(model)
    for p, n in zip(prompts, out_lens):
        engine.add_request(p, max_new_tokens=n, do_sample=False, eos_token_id=None)
    scheduler = engine.core.scheduler
    kinds = []  # per scheduled step: whether it holds prompt tokens (more tokens than requests)
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        kinds.append(out.num_batched_tokens > len(out.scheduled))
        return out

    scheduler.schedule = recording_schedule
    max_running, num_tokens, steps = 0, 0, 0
    split = {"prefill_s": 0.0, "prefill_steps": 0, "decode_s": 0.0, "decode_steps": 0}
    torch.cuda.synchronize()
    t0 = last = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += len(engine.step())
        max_running = max(max_running, len(scheduler.running))
        steps += 1
        now = time.perf_counter()
        # a step's wall time mostly waits on the step before it (launched one step ahead): charge it to that one
        kind = "prefill" if kinds[max(0, len(kinds) - 2)] else "decode"
        split[f"{kind}_s"] += now - last
        split[f"{kind}_steps"] += 1
        last = now
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    scheduler.schedule = schedule
    stats = hfpaged.stats(model)
    prompt_tokens = sum(map(len, prompts))
    return {
        "seconds": seconds,
        "output_tokens": num_tokens,
        "output_tokens_per_s": num_tokens / seconds,
        "all_tokens_per_s": (num_tokens + prompt_tokens) / seconds,
        "max_running": max_running,
        "steps": steps,
        "num_preemptions": stats["num_preemptions"],
        "num_blocks": stats["num_blocks"],
        "pool_tokens": stats["num_blocks"] * stats["block_size"],
        "pool_gib": stats["num_blocks"] * stats["block_size"] * stats["kv_cache_bytes_per_token"] / 2**30,
        "kv_cache_dtype": stats["kv_cache_dtype"],
        "step_split": split,
    }


def bench(model, name, prompts, out_lens, pool_gib, results, out_dir, triton_decode=False, old_splits=False,
          repeats=1, rows_together=False):  # fmt: skip
    results[name] = {}
    runs = [("auto", "auto"), ("fp8", "fp8")] + ([("fp8_triton", "fp8")] if triton_decode else [])
    runs += [("fp8_old_splits", "fp8")] if old_splits else []
    runs += [("fp8_rows_together", "fp8")] if rows_together else []
    for label, kv in runs:
        fp8_decode.USE_CUDA_FP8_DECODE = label != "fp8_triton"
        attention_config.CUDA_FP8_CTAS_PER_SM = 0 if label == "fp8_old_splits" else CUDA_FP8_CTAS_PER_SM
        paged_attention_module.DECODE_ROWS_APART = "never" if label == "fp8_rows_together" else DECODE_ROWS_APART
        if pool_gib is None:
            hfpaged.patch(model, gpu_memory_utilization=0.9, kv_cache_dtype=kv)
        else:
            block_bytes = 16 * kv_bytes_per_token(model, kv)
            hfpaged.patch(model, num_blocks=int(pool_gib * 2**30) // block_bytes, kv_cache_dtype=kv)
        short = [p[:256] for p in prompts[:8]]
        model.generate_many(short, max_new_tokens=32, do_sample=False)  # warm-up: kernels, graphs, calibration
        model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
        entries = []
        for _ in range(repeats):
            hfpaged.reset_prefix_cache(model)  # the timed run prefills every prompt in full
            entries.append(run(model, prompts, out_lens))
        # the median run by output tokens/s (every run's figure kept beside it)
        entry = sorted(entries, key=lambda e: e["output_tokens_per_s"])[len(entries) // 2]
        entry["runs_output_tokens_per_s"] = [e["output_tokens_per_s"] for e in entries]
        results[name][label] = entry
        print(name, label, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}),
              flush=True)  # fmt: skip
        hfpaged.unpatch(model)
        torch.cuda.empty_cache()
        (out_dir / "bench_fp8_kv.json").write_text(json.dumps(results, indent=2))
    fp8_decode.USE_CUDA_FP8_DECODE, attention_config.CUDA_FP8_CTAS_PER_SM = True, CUDA_FP8_CTAS_PER_SM  # the defaults
    paged_attention_module.DECODE_ROWS_APART = DECODE_ROWS_APART
    a, f = results[name]["auto"], results[name]["fp8"]
    results[name]["ratio"] = {
        "output_tokens_per_s": f["output_tokens_per_s"] / a["output_tokens_per_s"],
        "all_tokens_per_s": f["all_tokens_per_s"] / a["all_tokens_per_s"],
        "max_running": f["max_running"] / a["max_running"],
        "pool_tokens": f["pool_tokens"] / a["pool_tokens"],
    }
    if triton_decode:
        results[name]["ratio"]["fp8_cuda_over_fp8_triton"] = (
            f["output_tokens_per_s"] / results[name]["fp8_triton"]["output_tokens_per_s"]
        )
    for flag, label in ((old_splits, "fp8_old_splits"), (rows_together, "fp8_rows_together")):
        if flag:
            results[name]["ratio"][f"fp8_over_{label}"] = (
                f["output_tokens_per_s"] / results[name][label]["output_tokens_per_s"]
            )
    (out_dir / "bench_fp8_kv.json").write_text(json.dumps(results, indent=2))


def kernel_times(results) -> None:
    """Decode attention (Qwen3-0.6B heads: 16 query, 8 KV, 128 dims) and store_kv, bf16 vs fp8 cache, in us."""
    from hfpaged.kernels import paged_attention, store_kv

    out = results.setdefault("kernels", {})
    for batch, ctx in ((8, 2048), (64, 1024), (128, 2048), (256, 1024), (16, 8192)):
        blocks = batch * ctx // 16
        table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 16, 128, dtype=torch.bfloat16, device="cuda")
        times = {}
        for kv in ("auto", "fp8"):
            k = torch.randn(blocks, 16, 8, 128, device="cuda")
            scale = torch.ones(1, device="cuda")
            extra = {} if kv == "auto" else {"k_scale": scale, "v_scale": scale}
            k = k.to(torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn)
            v = k.clone()

            def call(k=k, v=v, extra=extra):
                paged_attention(q, k, v, table, seq_lens, cu, scale=0.088, max_seqlen_q=1, max_seqlen_k=ctx, **extra)

            for _ in range(3):
                call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[kv] = start.elapsed_time(end) / 50 * 1e3
            del k, v
        key_bytes = batch * ctx * 8 * 128 * 2
        out[f"B{batch}_ctx{ctx}"] = {"bf16_us": times["auto"], "fp8_us": times["fp8"],
                                     "bf16_GBps": 2 * key_bytes / times["auto"] / 1e3,
                                     "fp8_GBps": key_bytes / times["fp8"] / 1e3}  # fmt: skip
        print("decode attention", batch, ctx, json.dumps(out[f"B{batch}_ctx{ctx}"]), flush=True)
    tokens = 8192
    key = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda")
    for kv in ("auto", "fp8"):
        cache = torch.zeros(tokens // 16, 16, 8, 128, device="cuda").to(
            torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn
        )
        extra = (
            {} if kv == "auto" else {"k_scale": torch.ones(1, device="cuda"), "v_scale": torch.ones(1, device="cuda")}
        )
        for _ in range(3):
            store_kv(key, key, cache, cache.clone(), slots, **extra)
        c2 = cache.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            store_kv(key, key, cache, c2, slots, **extra)
        torch.cuda.synchronize()
        out[f"store_kv_8k_{kv}_us"] = (time.perf_counter() - t0) / 50 * 1e6
    print("store_kv", json.dumps({k: v for k, v in out.items() if k.startswith("store")}), flush=True)


def table(results) -> str:
    lines = [f"{'workload':10} {'kv':17} {'pool tok':>9} {'max run':>7} {'preempt':>7} {'out tok/s':>9} "
             f"{'all tok/s':>9} {'seconds':>7}"]  # fmt: skip
    for name, runs in results.items():
        if not isinstance(runs, dict) or "auto" not in runs:
            continue
        for kv in ("auto", "fp8", "fp8_triton", "fp8_old_splits", "fp8_rows_together"):
            if kv in runs:
                e = runs[kv]
                lines.append(f"{name:10} {kv:17} {e['pool_tokens']:9d} {e['max_running']:7d} {e['num_preemptions']:7d} "
                             f"{e['output_tokens_per_s']:9.0f} {e['all_tokens_per_s']:9.0f} {e['seconds']:7.1f}")  # fmt: skip
        if "ratio" in runs:
            r = runs["ratio"]
            lines.append(f"{name:10} fp8/bf16: out tok/s {r['output_tokens_per_s']:.2f}x, all tok/s "
                         f"{r['all_tokens_per_s']:.2f}x, max running {r['max_running']:.2f}x")  # fmt: skip
            if "fp8_cuda_over_fp8_triton" in r:
                lines.append(
                    f"{name:10} fp8 CUDA decode / Triton decode: out tok/s {r['fp8_cuda_over_fp8_triton']:.2f}x"
                )
            if "fp8_over_fp8_old_splits" in r:
                lines.append(f"{name:10} fp8 CUDA split rule / Triton split rule: out tok/s "
                             f"{r['fp8_over_fp8_old_splits']:.3f}x")  # fmt: skip
            if "fp8_over_fp8_rows_together" in r:
                lines.append(f"{name:10} fp8 decode rows apart / together in prompt steps: out tok/s "
                             f"{r['fp8_over_fp8_rows_together']:.3f}x")  # fmt: skip
    return "\n".join(lines)


def plot(results, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n, r in results.items() if isinstance(r, dict) and "ratio" in r]
    if not names:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "output_tokens_per_s", "output tokens / s"),
        (axes[1], "max_running", "max running"),
    ):
        for i, kv in enumerate(("auto", "fp8")):
            xs = [j + (i - 0.5) * 0.4 for j in range(len(names))]
            ax.bar(xs, [results[n][kv][key] for n in names], 0.4, label="bf16 KV" if kv == "auto" else "fp8 KV")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{results.get('model')} ({results.get('device')}): bf16 vs fp8 KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(MODELS))
    parser.add_argument("--workloads", nargs="+", default=["long", "nano", "nano_full"],
                        choices=["long", "nano", "nano_full", "kernels"])  # fmt: skip
    parser.add_argument("--pool-gib", type=float, default=8.0)
    parser.add_argument("--long-requests", type=int, default=32)
    parser.add_argument("--long-new-tokens", type=int, default=512)
    parser.add_argument("--nano-requests", type=int, default=256)
    parser.add_argument("--out", default="bench_fp8")
    parser.add_argument("--triton-decode", action="store_true", help="also run fp8 with the Triton decode kernel")
    parser.add_argument("--old-splits", action="store_true",
                        help="also run fp8 with the CUDA decode kernel on the Triton kernel's split rule")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per patch; the median is reported")
    parser.add_argument("--rows-together", action="store_true",
                        help="also run fp8 with a prompt step's decode rows inside its prompt launch")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_kv.py needs a CUDA GPU")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model, torch.bfloat16)
    vocab = model.config.vocab_size
    results = {"model": args.model, "device": torch.cuda.get_device_name(), "pool_gib": args.pool_gib,
               "args": vars(args)}  # fmt: skip
    for name in args.workloads:
        if name == "kernels":
            kernel_times(results)
            (out_dir / "bench_fp8_kv.json").write_text(json.dumps(results, indent=2))
            continue
        if name == "long":
            prompts, out_lens = long_workload(args.long_requests, args.long_new_tokens, vocab)
        else:
            prompts, out_lens = workload("nano", args.nano_requests, vocab)
        pool = None if name == "nano_full" else args.pool_gib
        bench(model, name, prompts, out_lens, pool, results, out_dir, args.triton_decode, args.old_splits, args.repeats,
              args.rows_together)  # fmt: skip
    print(table(results), flush=True)
    (out_dir / "table.txt").write_text(table(results) + "\n")
    plot(results, out_dir / "bench_fp8_kv.png")


if __name__ == "__main__":
    main()
