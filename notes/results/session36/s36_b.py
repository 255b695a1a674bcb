"""Session 36 probe B: the prompt launches' program order in the engine (Qwen3-0.6B shape, random bf16 weights,
default options). Old kernels (HEAD's copy as ``oldkernels``, made by the call script) and new alternate: the query
launches go through ``paged_attention.launch_attention_kernel``, which this probe points at the old copy's launch
(decode launches are the same code in both). Each variant patches afresh (graphs captured with its launches), then
times the long workload's prefill (32 prompts of 4-8k tokens, one new token) and chat (256 prompts of 32-512, 128
new) three times each.

    OUT=dir python notes/results/session36/s36_b.py
"""

import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "examples"))
import benchmark  # noqa: E402
import oldkernels.attention_launch  # noqa: E402

import hfpaged  # noqa: E402
import hfpaged.kernels.paged_attention  # noqa: E402
from hfpaged.kernels import attention_launch  # noqa: E402

paged_attention = sys.modules["hfpaged.kernels.paged_attention"]

OUT = os.environ.get("OUT", ".")
LAUNCH = {"new": attention_launch.launch_attention_kernel, "old": oldkernels.attention_launch.launch_attention_kernel}


def main():
    model = benchmark.build_model("qwen3-0.6b", torch.bfloat16)
    vocab = model.config.vocab_size
    long_prompts, _ = benchmark.workload("long", 32, vocab)
    chat_prompts, chat_out = benchmark.workload("chat", 256, vocab, seed=1)
    res = {"device": torch.cuda.get_device_name(), "runs": []}
    for variant in ("new", "old", "new", "old"):
        paged_attention.launch_attention_kernel = LAUNCH[variant]
        hfpaged.patch(model, max_num_seqs=256)
        try:
            model.generate_many(long_prompts[:4], max_new_tokens=1, do_sample=False)  # warm-up
            prefill = []
            for _ in range(3):
                hfpaged.reset_prefix_cache(model)
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate_many(long_prompts, max_new_tokens=1, do_sample=False, eos_token_id=None)
                torch.cuda.synchronize()
                prefill.append(time.perf_counter() - t)
            tokens, dt, _, runs = benchmark.timed_runs(model, chat_prompts, chat_out, 3)
        finally:
            hfpaged.unpatch(model)
        row = dict(variant=variant, long_prefill_s=prefill, long_prefill_median_s=statistics.median(prefill),
                   chat_tok_s=runs, chat_median_tok_s=statistics.median(runs))  # fmt: skip
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(OUT, "s36_b.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
