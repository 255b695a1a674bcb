"""Probe D (session 18): host time per step of ``generate_many`` (the main API) without its forward, on the CPU.

PYTHONPATH=<tree> python notes/results/session18/s18_d.py [REPEATS]
A 1-layer tiny Llama (the forward's time is measured and subtracted); chat (256 prompts of 32-512 tokens, 128 new)
and churn (1,000 prompts of 16-64 tokens, 16-64 new each, as per-prompt settings). Prints the host ms per step of
each repeat after the first and a checksum of the tokens (equal across trees).
"""

import sys
import time
import zlib

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hfpaged
from hfpaged.model import runner as R

forward_seconds = [0.0]
_forward = R.ModelRunner.forward


def timed_forward(*args, **kwargs):
    start = time.perf_counter()
    try:
        return _forward(*args, **kwargs)
    finally:
        forward_seconds[0] += time.perf_counter() - start


R.ModelRunner.forward = timed_forward


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    hfpaged.patch(model, num_blocks=40000, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192)
    core = model._hfpaged.engine
    for kind, n in (("chat", 256), ("churn", 1000)):
        gen = torch.Generator().manual_seed(0)
        if kind == "chat":
            in_lens, out_lens = torch.randint(32, 513, (n,), generator=gen).tolist(), [128] * n
        else:
            in_lens = torch.randint(16, 65, (n,), generator=gen).tolist()
            out_lens = torch.randint(16, 65, (n,), generator=gen).tolist()
        prompts = [
            {"prompt": torch.randint(10, 990, (k,), generator=gen).tolist(), "max_new_tokens": m}
            for k, m in zip(in_lens, out_lens)
        ]
        per_step = []
        for rep in range(repeats):
            hfpaged.reset_prefix_cache(model)
            steps0 = core.timings["steps"]
            forward_seconds[0] = 0.0
            start = time.perf_counter()
            results = model.generate_many(prompts, do_sample=False, eos_token_id=None)
            seconds = time.perf_counter() - start - forward_seconds[0]
            if rep:
                per_step.append(seconds / (core.timings["steps"] - steps0) * 1e3)
        crc = zlib.crc32(repr([r.token_ids for r in results]).encode())
        print(f"{kind}: host excl. forward per step ms: {' '.join(f'{x:.3f}' for x in per_step)}  tokens-crc {crc}")


if __name__ == "__main__":
    main()
