"""Probe A (session 21): decode steps storing their K/V inside the attention kernel, off / on alternating in one
process (``kernels.paged_attention.STORE_IN_KERNEL``; each setting a fresh patch, so the graphs are captured with it).

python notes/results/session21/s21_a.py MODEL[,MODEL...] REPS [SWITCH] [--dry-run]
SWITCH: the ``kernels.paged_attention`` flag toggled (default STORE_IN_KERNEL; PREFETCH_TABLE, commit 67b030f: the programs
prefetch their first tile's block ids before the dependent-launch wait).
Per model, repeat and setting: batch-1 ms/token (benchmark.batch1_latency: 128-token prompt, 256 new, median of 3)
and the output tok/s of 256 requests of 200-400 prompt tokens x 64 new tokens (generate_many), with the greedy
tokens of both settings compared.
"""

import importlib
import os
import sys
import time

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))  # _probe.py
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402

DRY = "--dry-run" in sys.argv
pa_module = importlib.import_module("hfpaged.kernels.paged_attention")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    switch = args[2] if len(args) > 2 else "STORE_IN_KERNEL"
    for name in names:
        model = probe_model(name, DRY)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        n, new = (256, 64) if not DRY else (4, 3)
        prompts = [torch.randint(10, vocab - 10, (int(torch.randint(200, 401, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(n)]  # fmt: skip
        tokens = {}
        for rep in range(reps):
            for fused in (False, True):
                setattr(pa_module, switch, fused)
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                ms = sorted(benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4) for _ in range(3))[1]
                model.generate_many(prompts[:8], max_new_tokens=4, do_sample=False, eos_token_id=None)  # warm
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                out = model.generate_many(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                tps = n * new / (time.perf_counter() - t1)
                tokens[fused] = [r.token_ids for r in out]
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} {switch}={fused}: batch-1 {ms:.3f} ms/token; batch {n} x {new}: "
                      f"{tps:,.0f} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(f"[{name}] greedy outputs equal with {switch} off and on: {same} of {n}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
