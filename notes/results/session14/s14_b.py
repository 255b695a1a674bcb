"""Session 14 probe B: the fp8 benchmark's workloads (examples/bench_fp8_kv.py) with today's split policy (2 programs
per SM) and with more splits (PPS programs per SM) for small decode batches, A/B in one process."""

import json
import os
import sys

sys.path.insert(0, "examples")
import torch

import bench_fp8_kv as bf
import benchmark as bm
import hfpaged
from hfpaged.kernels import attention_config as ac

OUT = os.environ.get("OUT", ".")
orig = ac.split_count
res = {}
model = bm.build_model("qwen3-0.6b", torch.bfloat16)
vocab = model.config.vocab_size
work = {
    "long": bf.long_workload(48, 512, vocab),
    "nano": bm.workload("nano", 256, vocab),
}
for pps in [int(x) for x in sys.argv[1:]]:
    ac.split_count = (lambda a, k, s, programs_per_sm=2, _p=pps: orig(a, k, s, _p))
    for wname, (prompts, out_lens) in work.items():
        for kv in ("auto", "fp8"):
            block_bytes = 16 * bf.kv_bytes_per_token(model, kv)
            hfpaged.patch(model, num_blocks=int(8 * 2**30) // block_bytes, kv_cache_dtype=kv)
            short = [p[:256] for p in prompts[:8]]
            model.generate_many(short, max_new_tokens=32, do_sample=False)
            model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
            e = bf.run(model, prompts, out_lens)
            res[f"{wname}_{kv}_pps{pps}"] = e
            print(wname, kv, "pps", pps, f"{e['output_tokens_per_s']:.0f} tok/s steps {e['steps']} "
                  f"max_running {e['max_running']} preempt {e['num_preemptions']} {e['seconds']:.2f}s", flush=True)
            hfpaged.unpatch(model)
            torch.cuda.empty_cache()
            json.dump(res, open(os.path.join(OUT, "s14_b.json"), "w"), indent=1)
