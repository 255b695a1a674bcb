"""Probe B (session 18): what Python's garbage collector costs the step loop, on the GPU machine.

PYTHONPATH=<tree> python notes/results/session18/s18_b.py MODEL [REPEATS] [KINDS]
One process, the benchmark's workloads after its warm-up; per repeat three variants in turn: the collector as it is
("default"), the same after ``gc.freeze()`` of everything alive after the warm-up ("frozen", undone after the run),
and the collector off during the run ("off", upper bound). Prints tok/s, the engine's host phases per step, the
collector's passes (count and seconds per generation) and the steps the device waited on the host.
"""

import gc
import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, run_hfpaged, workload  # noqa: E402

import hfpaged  # noqa: E402


def one_run(label, name, kind, model, prompts, outs, variant):
    hfpaged.reset_prefix_cache(model)
    gc.collect()
    if variant == "frozen":
        gc.freeze()
    elif variant == "off":
        gc.disable()
    try:
        tokens, dt, _, eng = run_hfpaged(model, prompts, outs)
    finally:
        gc.enable()
        gc.unfreeze()
    core = eng.core
    steps = core.timings["steps"]
    phases = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in core.timings.items() if k != "steps")
    passes = " ".join(f"{g} {p['count']}/{p['total_s'] * 1e3:.0f}ms" for g, p in eng.gc_pauses.items())
    bound = eng.host_bound
    print(
        f"[{label} {name} {kind} {variant:7s}] {tokens / dt:,.0f} tok/s, {steps:.0f} steps; per step ms: {phases}; "
        f"gc {passes}; device waited in {bound['ready_before_read']}/{bound['overlapped_steps']}",
        flush=True,
    )


def main():
    name = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    kinds = sys.argv[3].split(",") if len(sys.argv) > 3 else ["chat", "churn"]
    print(f"hfpaged from {hfpaged.__file__}; python {sys.version.split()[0]}; gc threshold {gc.get_threshold()}")
    model = build_model(name, torch.bfloat16)
    t = time.perf_counter()
    hfpaged.patch(model)
    for kind in kinds:
        prompts, outs = workload(kind, 256 if kind == "chat" else 1000, model.config.vocab_size)
        run_hfpaged(model, prompts[:32], outs[:32])
        print(f"tracked objects after the warm-up: {len(gc.get_objects()):,}", flush=True)
        for rep in range(repeats):
            for variant in ("default", "frozen", "off"):
                one_run(rep, name, kind, model, prompts, outs, variant)
    print(f"total {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
