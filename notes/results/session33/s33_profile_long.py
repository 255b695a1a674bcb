"""Session 33 probe: where the long-prompt workload's GPU time goes, bf16 vs fp8 KV (issue 16).

    python notes/results/session33/s33_profile_long.py --out DIR [--requests 32]

bench_fp8_kv.py's long workload (8 GiB pool, Qwen3-0.6B shape, random weights) run under the torch profiler for
each KV dtype; prints and writes the kernels' total device time by name (top 30) and the whole device time.
"""

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
from bench_fp8_kv import kv_bytes_per_token, long_workload, run  # noqa: E402
from benchmark import build_model  # noqa: E402

import hfpaged  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--requests", type=int, default=32)
    a = ap.parse_args()
    model = build_model("qwen3-0.6b", torch.bfloat16)
    prompts, out_lens = long_workload(a.requests, 512, model.config.vocab_size)
    result = {}
    for kv in ("auto", "fp8"):
        block_bytes = 16 * kv_bytes_per_token(model, kv)
        hfpaged.patch(model, num_blocks=(8 << 30) // block_bytes, kv_cache_dtype=kv)
        short = [p[:256] for p in prompts[:8]]
        model.generate_many(short, max_new_tokens=32, do_sample=False)
        model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
        hfpaged.reset_prefix_cache(model)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            entry = run(model, prompts, out_lens)
        rows = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0:
                rows.append((t / 1e3, ev.count, ev.key[:110]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"== {kv}: wall {entry['seconds']:.2f} s, steps {entry['steps']}, split {entry['step_split']}, "
              f"device kernels {total:.0f} ms", flush=True)  # fmt: skip
        for ms, count, name in rows[:30]:
            print(f"{ms:9.1f} ms {count:7d}  {name}", flush=True)
        result[kv] = dict(entry=entry, device_ms=total, top=[dict(ms=m, count=c, name=n) for m, c, n in rows[:60]])
        hfpaged.unpatch(model)
        torch.cuda.empty_cache()
        with open(os.path.join(a.out, "s33_profile_long.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
