"""Session 13: programmatic dependent launch, A/B/A/B in one process per model: batch-1 decode (all three shapes)
and, for Qwen3-0.6B, the nano and chat workloads. off = dependent_launch=False; on = the default on Hopper
(store_kv / paged_attention / merge and Inductor's kernels with PDL)."""

import json
import os
import sys
import time
import traceback

sys.path.insert(0, "examples")
import torch

import benchmark as bm
import hfpaged

OUT = os.environ.get("OUT", ".")
res = {}
for name in sys.argv[1:]:
    try:
        model = bm.build_model(name, torch.bfloat16)
        for label in ("off", "on", "off2", "on2"):
            on = label.startswith("on")
            hfpaged.patch(model, max_num_seqs=8, max_num_batched_tokens=1024, dependent_launch=on)
            bm.batch1_latency(model, new_tokens=16)
            ms = [bm.batch1_latency(model) for _ in range(4)]
            res[f"{name}_b1_{label}"] = ms
            print(name, "batch1", label, [round(m, 4) for m in ms], "pdl", model._hfpaged.dependent_launch, flush=True)
            hfpaged.unpatch(model)
        if name == "qwen3-0.6b":
            for kind in ("nano", "chat"):
                prompts, out_lens = bm.workload(kind, 256, model.config.vocab_size)
                for label in ("off", "on", "off2", "on2"):
                    hfpaged.patch(model, dependent_launch=label.startswith("on"))
                    bm.run_hfpaged(model, prompts[:16], [16] * 16)  # warm-up: capture and compile
                    tokens, dt, _, engine = bm.run_hfpaged(model, prompts, out_lens)
                    res[f"{name}_{kind}_{label}"] = {"tok_s": tokens / dt, "seconds": dt}
                    print(name, kind, label, f"{tokens / dt:.0f} tok/s {dt:.2f}s", flush=True)
                    hfpaged.unpatch(model)
        del model
        torch.cuda.empty_cache()
    except Exception:
        traceback.print_exc()
        print(name, "FAILED", flush=True)
    json.dump(res, open(os.path.join(OUT, "s13_b.json"), "w"), indent=1)
