"""Probe B (session 19): chat throughput through ``generate_many`` with the one-query decode map on or off.

python notes/results/session19/s19_b.py on|off MODEL RUNS [--dry-run]
"off" wraps the attention config choice so ``one_query`` is always False (the kernel's sequence search, as before
session 19). Warm-up on 32 prompts, prefix-cache reset before each run; tok/s per run and a checksum of the tokens.
"""

import dataclasses
import sys
import time

import torch

sys.path.insert(0, "examples")
from benchmark import build_model, workload  # noqa: E402

import hfpaged  # noqa: E402
import importlib  # noqa: E402

pa = importlib.import_module("hfpaged.kernels.paged_attention")  # the package exports a function of that name


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    label, name, runs = args[0], args[1], int(args[2])
    dry = "--dry-run" in sys.argv
    if label == "off":
        choose = pa.choose_config
        pa.choose_config = lambda **kw: dataclasses.replace(choose(**kw), one_query=False)
    if dry:
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        hfpaged.patch(model, compile=False)
        n = 16
    else:
        model = build_model(name, torch.bfloat16)
        hfpaged.patch(model)
        n = 256
    prompts, outs = workload("chat", n, model.config.vocab_size)
    outs = [8] * n if dry else outs
    model.generate_many(prompts[:32], max_new_tokens=outs[0], do_sample=False, eos_token_id=None)
    core = model._hfpaged.engine
    for rep in range(runs):
        hfpaged.reset_prefix_cache(model)
        ready, overlapped = core.num_ready_reads, core.num_overlapped_steps
        if not dry:
            torch.cuda.synchronize()
        start = time.perf_counter()
        results = model.generate_many(prompts, max_new_tokens=outs[0], do_sample=False, eos_token_id=None)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        checksum = sum(hash(tuple(r.token_ids)) % 1000003 for r in results) % 1000003
        print(
            f"[{label} {name} chat] run {rep}: {tokens / seconds:,.0f} tok/s; checksum {checksum}; device waited in "
            f"{core.num_ready_reads - ready}/{core.num_overlapped_steps - overlapped} steps",
            flush=True,
        )


if __name__ == "__main__":
    main()
