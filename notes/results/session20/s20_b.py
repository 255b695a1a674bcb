"""Probe B (session 20): batch-1 decode ms/token by the small-batch split rule (SMALL_BATCH_MIN_SPLIT_TILES).

python notes/results/session20/s20_b.py MODEL[,MODEL...] REPS TILES[,TILES...] [--dry-run]
One process; per model and repeat, each TILES value in turn (a fresh patch each): benchmark.batch1_latency at a
128-token prompt (256 new, the benchmark's) and at a 2,000-token prompt (128 new). On a tree without the setting (the
merge kernel's code) TILES is ignored and one "base" value runs.
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
from hfpaged.kernels import attention_config  # noqa: E402

DRY = "--dry-run" in sys.argv


def main(setting="SMALL_BATCH_MIN_SPLIT_TILES", label="min_tiles"):
    """``setting``: the attention_config integer each TILES value sets (s20_e.py: MAX_SPLITS)."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    names, reps, tiles = args[0].split(","), int(args[1]), [int(t) for t in args[2].split(",")]
    print(f"hfpaged from {hfpaged.__file__}", flush=True)
    if not hasattr(attention_config, setting):
        tiles = [None]
    for name in names:
        model = probe_model(name, DRY)
        for rep in range(reps):
            for t in tiles:
                if t is not None:
                    setattr(attention_config, setting, t)
                start = time.perf_counter()
                hfpaged.patch(model)
                short = benchmark.batch1_latency(model, new_tokens=256 if not DRY else 4)
                long = benchmark.batch1_latency(model, prompt_len=2000 if not DRY else 40, new_tokens=128 if not DRY else 4)
                hfpaged.unpatch(model)
                print(f"[{name}] rep {rep} {label}={t}: batch-1 {short:.3f} ms/token at 128-384 keys, "
                      f"{long:.3f} at 2000-2128 keys ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        del model
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
