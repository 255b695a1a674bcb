"""Session 16 probe B: fp8 KV caches with rows of whole sequences (context_rows.py) off / on / off / on, one process.

Qwen3-0.6B shape, bf16 model, fp8 (e4m3) cache of 8 GiB as `bench_fp8_kv.py` builds it. Per variant (graphs
re-captured): 32 long prompts (4-8k) prefilled with one new token each, the fp8 benchmark's long workload (48 prompts,
128 new tokens), and the prefill again under the torch profiler (GPU time of the attention and copy kernels);
greedy tokens compared across variants.
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
OUT = os.environ.get("OUT", ".")


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    from bench_fp8_kv import kv_bytes_per_token, long_workload, run
    from benchmark import build_model, workload

    model = build_model("qwen3-0.6b", torch.bfloat16)
    prompts, _ = workload("long", 32, model.config.vocab_size)
    long_prompts, long_outs = long_workload(48, 128, model.config.vocab_size)
    num_blocks = int(8 * 2**30) // (16 * kv_bytes_per_token(model, "fp8"))
    res, tokens = [], {}
    for on in (False, True, False, True):
        pa.CONTEXT_MIN_TOKENS = 2048 if on else 1 << 30
        hfpaged.patch(model, num_blocks=num_blocks, kv_cache_dtype="fp8")
        try:
            short = [p[:256] for p in long_prompts[:8]]
            model.generate_many(short, max_new_tokens=32, do_sample=False)
            model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
            model.generate_many([p[:3000] for p in prompts[:2]], max_new_tokens=2, do_sample=False)
            hfpaged.reset_prefix_cache(model)
            outs, dt_prefill = timed(
                lambda: model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
            )
            hfpaged.reset_prefix_cache(model)
            entry = run(model, long_prompts, long_outs)
            hfpaged.reset_prefix_cache(model)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timed(lambda: model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None))
            kernels = {}
            for e in prof.key_averages():
                if e.self_device_time_total > 0:
                    kernels[e.key] = e.self_device_time_total / 1e3
            row = dict(
                rows=on,
                prefill_s=dt_prefill,
                prefill_tok_per_s=sum(map(len, prompts)) / dt_prefill,
                long_out_tok_per_s=entry["output_tokens_per_s"],
                long_s=entry["seconds"],
                long_steps=entry["steps"],
                long_preemptions=entry["num_preemptions"],
                gpu_ms=sum(kernels.values()),
                attention_ms=sum(v for k, v in kernels.items() if "paged_attention" in k),
                copy_ms=sum(v for k, v in kernels.items() if "context_rows" in k),
            )
            print(json.dumps(row), flush=True)
            res.append(row)
            key = "on" if on else "off"
            got = [o.token_ids for o in outs]
            if key in tokens:
                print(f"{key}: same prefill tokens as its first run: {tokens[key] == got}", flush=True)
            tokens[key] = got
        finally:
            hfpaged.unpatch(model)
        torch.cuda.empty_cache()
    print(f"on vs off: prefill tokens equal {tokens['on'] == tokens['off']}", flush=True)
    with open(os.path.join(OUT, "s16_b.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
