"""Session 16 probe A: context rows (context_rows.py) off / on / off / on in one process, Qwen3-0.6B shape, bf16.

Per variant (graphs re-captured, since a captured step bakes the decision): 32 long prompts (4-8k) prefilled with one
new token each (TFLOP/s with attention FLOPs counted, as benchmark.py's prefill section), the long workload (128 new
tokens each), then the prefill again under the torch profiler: GPU time of the attention kernel, of the copy kernel,
of all kernels; the number of copies made and how many sequences got rows; greedy tokens compared across variants.
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
ORIGINAL_COPY = pa.copy_context_rows
OUT = os.environ.get("OUT", ".")
copies = []


def counting_copy(*args, **kwargs):
    out = ORIGINAL_COPY(*args, **kwargs)
    copies.append(out[2])
    return out


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main():
    from benchmark import build_model, matmul_peak_tflops, prefill_flops, workload

    model = build_model("qwen3-0.6b", torch.bfloat16)
    prompts, _ = workload("long", 32, model.config.vocab_size)
    flops = prefill_flops(model, [len(p) for p in prompts])
    total_flops = flops["linear"] + flops["attention"]
    peak = matmul_peak_tflops()
    print(f"matmul peak {peak:.0f} TFLOP/s", flush=True)
    torch.cuda.empty_cache()
    pa.copy_context_rows = counting_copy
    res, tokens = [], {}
    for on in (False, True, False, True):
        pa.CONTEXT_MIN_TOKENS = 2048 if on else 1 << 30
        hfpaged.patch(model)
        try:
            model.generate_many([p[:3000] for p in prompts[:2]], max_new_tokens=2, do_sample=False)
            hfpaged.reset_prefix_cache(model)
            copies.clear()
            outs, dt_prefill = timed(
                lambda: model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
            )
            n_copies = len(copies)
            with_rows = sum(int((o >= 0).sum()) for o in copies)  # eager steps only (graph replays call nothing)
            hfpaged.reset_prefix_cache(model)
            long_outs, dt_long = timed(
                lambda: model.generate_many(prompts, max_new_tokens=128, do_sample=False, eos_token_id=None)
            )
            hfpaged.reset_prefix_cache(model)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                timed(lambda: model.generate_many(prompts, max_new_tokens=1, do_sample=False, eos_token_id=None))
            kernels = {}
            for e in prof.key_averages():
                if e.self_device_time_total > 0:
                    kernels[e.key] = e.self_device_time_total / 1e3
            gpu = sum(kernels.values())
            row = dict(
                context_rows=on,
                prefill_s=dt_prefill,
                prefill_tflops=total_flops / dt_prefill / 1e12,
                prefill_share_of_peak=total_flops / dt_prefill / 1e12 / peak,
                long_s=dt_long,
                long_tok_per_s=32 * 128 / dt_long,
                gpu_ms=gpu,
                attention_ms=sum(v for k, v in kernels.items() if "paged_attention" in k),
                copy_ms=sum(v for k, v in kernels.items() if "context_rows" in k),
                eager_copies=n_copies,
                eager_sequences_with_rows=with_rows,
                graph_steps=model._hfpaged.engine.runner.num_graph_steps,
                eager_steps=model._hfpaged.engine.runner.num_eager_steps,
            )
            print(json.dumps(row), flush=True)
            res.append(row)
            key = "on" if on else "off"
            got = ([o.token_ids for o in outs], [o.token_ids for o in long_outs])
            if key in tokens:
                print(f"{key}: same tokens as its first run: {tokens[key] == got}", flush=True)
            tokens[key] = got
        finally:
            hfpaged.unpatch(model)
        torch.cuda.empty_cache()
    print(f"on vs off: prefill tokens equal {tokens['on'][0] == tokens['off'][0]}, "
          f"long tokens equal {tokens['on'][1] == tokens['off'][1]}", flush=True)
    with open(os.path.join(OUT, "s16_a.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
