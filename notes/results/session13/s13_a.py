"""Session 13: batch-1 decode with programmatic dependent launch (PDL), variants in one process per model.

off:  dependent_launch=False (plain launches everywhere)
ours: dependent_launch=True, Inductor's kernels without PDL (only store_kv / paged_attention / merge)
all:  dependent_launch=True, Inductor's kernels with PDL too (the default on Hopper)
Each variant patches anew (max_num_seqs 8: few buckets, the batch-1 step runs in the 2-row graph), decodes 16
tokens to warm up, then times 3 x 256 tokens; the order off, ours, all, off, all repeats the baseline.
"""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, "examples")
import torch

import benchmark as bm
import hfpaged
from hfpaged.model import custom_ops

OUT = os.environ.get("OUT", ".")
res = {}
inductor_options = custom_ops.inductor_options
for name in sys.argv[1:]:
    try:
        model = bm.build_model(name, torch.bfloat16)
        for label in ("off", "ours", "all", "off2", "all2"):
            custom_ops.inductor_options = inductor_options if label.startswith("all") else (lambda pdl: {})
            t0 = time.perf_counter()
            hfpaged.patch(model, max_num_seqs=8, max_num_batched_tokens=1024, dependent_launch=not label.startswith("off"))
            bm.batch1_latency(model, new_tokens=16)
            setup = time.perf_counter() - t0
            ms = [bm.batch1_latency(model) for _ in range(3)]
            res[f"{name}_{label}"] = {"ms": ms, "setup_s": setup, "dependent_launch": model._hfpaged.dependent_launch}
            print(name, label, [round(m, 4) for m in ms], f"setup {setup:.1f}s", flush=True)
            hfpaged.unpatch(model)
        del model
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()
        print(name, "FAILED", flush=True)
    json.dump(res, open(os.path.join(OUT, "s13_a.json"), "w"), indent=1)
