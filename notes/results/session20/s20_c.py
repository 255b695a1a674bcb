"""Probe C (session 20): Inductor's combo kernels (independent kernels of a region launched as one) in the compiled
layers, off / on alternating in one process.

python notes/results/session20/s20_c.py MODEL[,MODEL...] REPS [--dry-run]
Per model, repeat and setting (a fresh patch each): batch-1 ms/token (benchmark.batch1_latency, 128-token prompt,
256 new) and the output tok/s of 256 requests of 200-400 prompt tokens x 64 new tokens (generate_many), with the
greedy tokens of both settings compared.
"""

import os
import sys
import time

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402
from hfpaged.model import custom_ops  # noqa: E402

DRY = "--dry-run" in sys.argv
BASE = custom_ops.inductor_options


def combo_options(launch_pdl):
    return {**BASE(launch_pdl), "combo_kernels": True}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        n, new = (256, 64) if not DRY else (4, 3)
        prompts = [torch.randint(10, vocab - 10, (int(torch.randint(200, 401, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(n)]  # fmt: skip
        tokens = {}
        for rep in range(reps):
            for combo in (False, True):
                custom_ops.inductor_options = combo_options if combo else BASE
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                ms = benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4)
                model.generate_many(prompts[:8], max_new_tokens=4, do_sample=False, eos_token_id=None)  # warm
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                out = model.generate_many(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                tps = n * new / (time.perf_counter() - t1)
                tokens[combo] = [r.token_ids for r in out]
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} combo_kernels={combo}: batch-1 {ms:.3f} ms/token; batch {n} x {new}: "
                      f"{tps:,.0f} tok/s ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(f"[{name}] greedy outputs equal with and without combo kernels: {same} of {n}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
