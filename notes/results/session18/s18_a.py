"""Probe A (session 18): host work of the chat and churn workloads on the GPU machine, for a py-spy profile.

PYTHONPATH=<tree> python notes/results/session18/s18_a.py LABEL MODEL [REPEATS]
The benchmark's workloads and warm-up (32 prompts, then the prefix cache reset); prints tok/s, the engine's host
phases per step and how many overlapped steps the device finished before the host read them (host-bound steps).
The timed runs happen inside ``timed_runs`` so that a profile can be cut down to them.
"""

import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, run_hfpaged, workload  # noqa: E402

import hfpaged  # noqa: E402


def timed_runs(label, name, kind, model, prompts, outs, repeats):
    for rep in range(repeats):
        hfpaged.reset_prefix_cache(model)
        tokens, dt, _, eng = run_hfpaged(model, prompts, outs)
        core = eng.core
        steps = core.timings["steps"]
        phases = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in core.timings.items() if k != "steps")
        print(
            f"[{label} {name} {kind}] run {rep}: {tokens / dt:,.0f} tok/s, {steps:.0f} steps; per step ms: {phases}; "
            f"host-bound {eng.host_bound}",
            flush=True,
        )


def main():
    label, name = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    kinds = sys.argv[4].split(",") if len(sys.argv) > 4 else ["chat", "churn"]
    print(f"[{label}] hfpaged from {hfpaged.__file__}", flush=True)
    model = build_model(name, torch.bfloat16)
    t = time.perf_counter()
    hfpaged.patch(model)
    for kind in kinds:
        prompts, outs = workload(kind, 256 if kind == "chat" else 1000, model.config.vocab_size)
        run_hfpaged(model, prompts[:32], outs[:32])
        timed_runs(label, name, kind, model, prompts, outs, repeats)
    print(f"[{label}] total {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
