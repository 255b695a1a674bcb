"""Session 15 probe E: does the engine's prefill take the step-rows tiles, and how much of its GPU time is attention?

Qwen3-0.6B shape, default options, 32 long prompts (4-8k) prefilled with one new token each, step rows off / on
(as probe D): counts the TMA descriptors built (at graph capture and in eager steps) and sums the GPU time of the
attention kernel against all kernels under the torch profiler (kernels replayed from CUDA graphs included).
"""

import importlib
import json
import os
import sys
import time

sys.path.insert(0, "examples")
import torch
from torch.profiler import ProfilerActivity, profile

import hfpaged

pa = importlib.import_module("hfpaged.kernels.paged_attention")
ORIGINAL_USABLE, ORIGINAL_DESC = pa.step_kv_usable, pa._step_descriptor
OUT = os.environ.get("OUT", ".")
built = [0]


def counting_descriptor(t, tile_n):
    built[0] += 1
    return ORIGINAL_DESC(t, tile_n)


def main():
    from benchmark import build_model, workload

    model = build_model("qwen3-0.6b", torch.bfloat16)
    prompts, _ = workload("long", 32, model.config.vocab_size)
    res = []
    pa._step_descriptor = counting_descriptor
    for rows_on in (False, True, False, True):
        pa.step_kv_usable = ORIGINAL_USABLE if rows_on else (lambda *a: False)
        built[0] = 0
        hfpaged.patch(model)
        try:
            model.generate_many([p[:3000] for p in prompts[:2]], max_new_tokens=2, do_sample=False)
            hfpaged.reset_prefix_cache(model)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            kernels = {}
            for e in prof.key_averages():
                if e.self_device_time_total > 0:
                    kernels[e.key] = e.self_device_time_total / 1e3
            total = sum(kernels.values())
            attention = sum(v for k, v in kernels.items() if "paged_attention" in k)
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
            row = dict(rows=rows_on, wall_s=dt, descriptors_built=built[0], gpu_ms=total, attention_ms=attention,
                       attention_share=attention / total, top=[(k[:60], round(v, 1)) for k, v in top])
            print(json.dumps(row), flush=True)
            res.append(row)
        finally:
            hfpaged.unpatch(model)
            pa.step_kv_usable = ORIGINAL_USABLE
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "s15_e.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
