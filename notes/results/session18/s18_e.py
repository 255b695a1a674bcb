"""Probe E (session 18): ``generate_many`` throughput on the GPU, for A/B runs of two code trees (one per process).

PYTHONPATH=<tree> python notes/results/session18/s18_e.py LABEL MODEL RUNS
The benchmark's chat workload through ``model.generate_many`` (the main API), after a warm-up on 32 prompts and a
prefix-cache reset before each run; prints tok/s per run and the steps whose tokens were ready before the host read them.
"""

import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, workload  # noqa: E402

import hfpaged  # noqa: E402


def main():
    label, name, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"[{label}] hfpaged from {hfpaged.__file__}", flush=True)
    model = build_model(name, torch.bfloat16)
    hfpaged.patch(model)
    prompts, outs = workload("chat", 256, model.config.vocab_size)
    model.generate_many(prompts[:32], max_new_tokens=outs[0], do_sample=False, eos_token_id=None)
    core = model._hfpaged.engine
    for rep in range(runs):
        hfpaged.reset_prefix_cache(model)
        ready, overlapped = core.num_ready_reads, core.num_overlapped_steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = model.generate_many(prompts, max_new_tokens=outs[0], do_sample=False, eos_token_id=None)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        print(
            f"[{label} {name} chat generate_many] run {rep}: {tokens / seconds:,.0f} tok/s; device waited in "
            f"{core.num_ready_reads - ready}/{core.num_overlapped_steps - overlapped} steps",
            flush=True,
        )


if __name__ == "__main__":
    main()
