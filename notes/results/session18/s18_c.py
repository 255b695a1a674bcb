"""Probe C (session 18): repeated chat runs in one process with the collector as it comes, no ``gc.collect()``
between runs (as a user's repeated calls): per run tok/s and the collector's passes by generation.

PYTHONPATH=<tree> python notes/results/session18/s18_c.py MODEL RUNS FREEZE_GC(0|1) [KIND]
"""

import gc
import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, run_hfpaged, workload  # noqa: E402

import hfpaged  # noqa: E402


def main():
    name, runs, freeze = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))
    kind = sys.argv[4] if len(sys.argv) > 4 else "chat"
    model = build_model(name, torch.bfloat16)
    hfpaged.patch(model, freeze_gc=freeze)
    prompts, outs = workload(kind, 256 if kind == "chat" else 1000, model.config.vocab_size)
    run_hfpaged(model, prompts[:32], outs[:32])
    print(f"freeze_gc={freeze}: frozen {gc.get_freeze_count():,}, tracked {len(gc.get_objects()):,}", flush=True)
    rates, full = [], []
    t = time.perf_counter()
    for rep in range(runs):
        hfpaged.reset_prefix_cache(model)
        tokens, dt, _, eng = run_hfpaged(model, prompts, outs)
        g = eng.gc_pauses
        rates.append(tokens / dt)
        full.append(g["gen2"]["total_s"])
        print(
            f"[{name} {kind} freeze_gc={freeze}] run {rep}: {tokens / dt:,.0f} tok/s; gc "
            + " ".join(f"{k} {v['count']}/{v['total_s'] * 1e3:.0f}ms" for k, v in g.items()),
            flush=True,
        )
    print(
        f"[{name} {kind} freeze_gc={freeze}] mean {sum(rates) / len(rates):,.0f} tok/s, min {min(rates):,.0f}, "
        f"max {max(rates):,.0f}; full passes {sum(1 for f in full if f)} ({sum(full) * 1e3:.0f} ms); "
        f"{time.perf_counter() - t:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
