"""Probe B (session 22): where a chat run's time goes, step by step (for the chat >= 30x target of issue 12).

python notes/results/session22/s22_b.py MODEL OUT_DIR [--dry-run]
Default options; the chat workload (256 requests, 32-512 prompt tokens, 128 new) once to warm up, then once more on
a reset prefix cache under the torch profiler. Kernels are grouped by the CUDA-graph launch they came from (the
launch's correlation id); per step: its scheduled tokens / sequences / decode rows, its span on the device (first
kernel start to last kernel end) and each kernel kind's marginal time (how far a kernel's end lies past the latest end
before it: dependent launch overlaps kernels, so durations would double-count). Prints the slowest steps, the means
of decode-only and mixed steps, and the device's idle time between steps.
"""

import collections
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))  # _probe.py
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402

DRY = "--dry-run" in sys.argv


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("paged_attention", "attention"), ("merge", "merge"), ("context_rows", "context_rows"),
                       ("store_kv", "store_kv"), ("gemv", "gemv"), ("argmax", "argmax")):  # fmt: skip
        if key in n:
            return label
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "ampere")):
        return "gemm"
    if n.startswith("triton_"):
        return "inductor"
    return "other"


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name, out_dir = args[0], args[1]
    os.makedirs(out_dir, exist_ok=True)
    model = probe_model(name, DRY)
    hfpaged.patch(model, compile=None if not DRY else False)
    n = 256 if not DRY else 4
    prompts, outs = benchmark.workload("chat", n, model.config.vocab_size)
    if DRY:
        prompts, outs = [p[:20] for p in prompts], [4] * n
    benchmark.run_hfpaged(model, prompts, outs)  # warm-up: the same workload
    hfpaged.reset_prefix_cache(model)
    scheduled = []
    scheduler = model._hfpaged.engine.scheduler
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        tokens = [s.num_tokens for s in out.scheduled]
        scheduled.append((sum(tokens), len(tokens), sum(t == 1 for t in tokens)))
        return out

    scheduler.schedule = recording_schedule
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        tokens, dt, _, _ = benchmark.run_hfpaged(model, prompts, outs)
        wall = time.perf_counter() - t0
    scheduler.schedule = schedule
    trace = os.path.join(out_dir, "trace.json")
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", ""))  # fmt: skip
    kernels = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e["args"].get("correlation")].append((e["ts"], e["ts"] + e["dur"], kind(e["name"])))
    steps = []
    for i, (_, corr) in enumerate(launches):
        ks = sorted(kernels.get(corr, []))
        if not ks:
            continue
        marginal, latest = collections.Counter(), ks[0][0]
        for start, end, k in ks:
            marginal[k] += max(0.0, end - max(latest, start))
            latest = max(latest, end)
        steps.append({"start": ks[0][0], "end": latest, "span_us": latest - ks[0][0], "kernels": len(ks),
                      "marginal_us": dict(marginal)})  # fmt: skip
    # graph launches and schedule calls come in the same order (the last schedule may launch nothing)
    for step, sched in zip(steps, scheduled):
        step["tokens"], step["seqs"], step["decode_rows"] = sched
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:])]
    print(f"[{name}] {tokens} tokens in {dt:.3f} s ({tokens / dt:,.0f} tok/s; wall with the profiler {wall:.3f} s); "
          f"{len(steps)} graph steps of {len(launches)} launches, {len(scheduled)} schedules; device busy "
          f"{sum(s['span_us'] for s in steps) / 1e6:.3f} s, idle between steps {sum(max(g, 0) for g in gaps) / 1e6:.3f} s")  # fmt: skip
    kinds = sorted({k for s in steps for k in s["marginal_us"]})

    def row(label, group):
        if not group:
            return
        mean = {k: sum(s["marginal_us"].get(k, 0) for s in group) / len(group) for k in kinds}
        span = sum(s["span_us"] for s in group) / len(group)
        toks = sum(s.get("tokens", 0) for s in group) / len(group)
        print(f"  {label}: {len(group)} steps, mean span {span / 1e3:.2f} ms, {toks:.0f} tokens; marginal ms: "
              + ", ".join(f"{k} {mean[k] / 1e3:.2f}" for k in kinds), flush=True)

    decode = [s for s in steps if s.get("tokens") == s.get("seqs")]
    mixed = [s for s in steps if s.get("tokens") != s.get("seqs")]
    row("decode-only", decode)
    row("mixed", mixed)
    print("  slowest steps:")
    for s in sorted(steps, key=lambda s: -s["span_us"])[:12]:
        print(f"    {s['span_us'] / 1e3:.2f} ms, {s.get('tokens')} tokens, {s.get('seqs')} seqs, {s.get('decode_rows')} "
              "decode rows; marginal ms: " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(s["marginal_us"].items())))  # fmt: skip
    json.dump({"steps": steps, "gaps_us": gaps}, open(os.path.join(out_dir, "steps.json"), "w"))
    os.remove(trace)


if __name__ == "__main__":
    main()
