"""Probe B (session 17): throughput and host phases of the chat and churn workloads, for A/B runs of two code trees.

PYTHONPATH=<tree> python notes/results/session17/s17_b.py LABEL MODEL [REPEATS]
The benchmark's workloads and warm-up (32 prompts, then the prefix cache reset); prints tok/s and the engine's
host phases per step for each repeat, and the python that ran (which hfpaged tree).
"""

import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, run_hfpaged, workload  # noqa: E402

import hfpaged  # noqa: E402


def main():
    label, name = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    print(f"[{label}] hfpaged from {hfpaged.__file__}", flush=True)
    model = build_model(name, torch.bfloat16)
    t = time.perf_counter()
    hfpaged.patch(model)
    for kind, n in (("chat", 256), ("churn", 1000)):
        prompts, outs = workload(kind, n, model.config.vocab_size)
        run_hfpaged(model, prompts[:32], outs[:32])
        for rep in range(repeats):
            hfpaged.reset_prefix_cache(model)
            tokens, dt, _, eng = run_hfpaged(model, prompts, outs)
            steps = eng.core.timings["steps"]
            phases = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in eng.core.timings.items() if k != "steps")
            print(f"[{label} {name} {kind}] run {rep}: {tokens / dt:,.0f} tok/s, {steps:.0f} steps; per step ms: {phases}",
                  flush=True)
    print(f"[{label}] total {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
