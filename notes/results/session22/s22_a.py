"""Probe A (session 22): a one-row projection's RMSNorm and residual add inside its GEMV (``hfpaged.model.gemv_fusion``,
Inductor's post-grad pass over the compiled layers), off / on alternating in one process (each setting a fresh patch,
so the layers compile and the graphs are captured with it).

python notes/results/session22/s22_a.py MODEL[,MODEL...] REPS [--dry-run]
Per model, repeat and setting: batch-1 ms/token (benchmark.batch1_latency: 128-token prompt, 256 new, median of 3)
and the greedy tokens of 8 prompts run one at a time (batch-1 steps, 48 new tokens), compared across the settings.
"""

import os
import sys
import time

import torch

sys.path.insert(0, "examples")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))  # _probe.py
import benchmark  # noqa: E402

import hfpaged  # noqa: E402
from _probe import probe_model  # noqa: E402
from hfpaged.model import gemv_fusion  # noqa: E402

DRY = "--dry-run" in sys.argv


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps = args[0].split(","), int(args[1])
    for name in names:
        model = probe_model(name, DRY)
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        new = 48 if not DRY else 3
        prompts = [torch.randint(10, vocab - 10, (int(torch.randint(20, 300, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(8 if not DRY else 2)]  # fmt: skip
        tokens = {}
        for rep in range(reps):
            for on in (False, True):
                gemv_fusion.ENABLED = on
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                ms = sorted(benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4) for _ in range(3))
                out = [model.generate_many([p], max_new_tokens=new, do_sample=False, eos_token_id=None)[0].token_ids
                       for p in prompts]  # fmt: skip
                tokens.setdefault(on, out)
                same_rep = sum(a == b for a, b in zip(tokens[on], out))
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} fusion={on}: batch-1 {ms[1]:.3f} ms/token (runs {', '.join(f'{m:.3f}' for m in ms)}); "
                      f"batch-1 greedy equal to this setting's first rep: {same_rep} of {len(prompts)} "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        same = sum(a == b for a, b in zip(tokens[False], tokens[True]))
        first = sum(a[0] == b[0] for a, b in zip(tokens[False], tokens[True]))
        print(f"[{name}] batch-1 greedy outputs equal with the fusion off and on: {same} of {len(prompts)} "
              f"({first} with the same first token)", flush=True)  # fmt: skip
        del model
        if not DRY:
            torch.cuda.empty_cache()
    gemv_fusion.ENABLED = True


if __name__ == "__main__":
    main()
