"""Probe B (session 21): the outer-product bmm rule (``custom_ops.outer_product_bmm``) off / on alternating in one
process, decode steps storing K/V in the attention kernel in both. Compile caches off (Inductor's FX graph cache and
hfpaged's), so every patch compiles its layers with the rule as set.

Runs against commit 9b21fd1 (the rule was removed after this probe measured no gain).
TORCHINDUCTOR_FX_GRAPH_CACHE=0 python notes/results/session21/s21_b.py MODEL[,MODEL...] REPS [--dry-run]
Per model, repeat and setting: batch-1 ms/token (benchmark.batch1_latency, median of 3) and the greedy tokens of 32
requests (200-400 prompt tokens, 32 new) compared between the settings.
"""

import os
import sys
import time

import torch
from torch._inductor import decomposition

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))  # _probe.py
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402
from hfpaged.model import custom_ops  # noqa: E402

DRY = "--dry-run" in sys.argv
BMM = torch.ops.aten.bmm.default
ORIGINAL = decomposition.decompositions[BMM]
ADD_RULE = custom_ops.outer_product_bmm


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        n, new = (32, 32) if not DRY else (4, 3)
        prompts = [torch.randint(10, vocab - 10, (int(torch.randint(200, 401, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(n)]  # fmt: skip
        tokens = {}
        for rep in range(reps):
            for rule in (False, True):
                decomposition.decompositions[BMM] = ORIGINAL
                custom_ops.outer_product_bmm = ADD_RULE if rule else (lambda: False)
                added = ADD_RULE() if rule else False
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False, compile_cache_dir="")
                ms = sorted(benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4) for _ in range(3))[1]
                out = model.generate_many(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
                tokens[rule] = [r.token_ids for r in out]
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} outer-product rule={rule} (added by hfpaged: {added}): batch-1 {ms:.3f} "
                      f"ms/token ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        print(f"[{name}] greedy outputs equal with and without the rule: {same} of {n}", flush=True)
        del model
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
