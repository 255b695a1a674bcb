"""Probe D (session 21): the nano-vllm shape over an 8 GiB fp8 (e4m3) pool, decode steps storing K/V in the attention
kernel off / on (``kernels.paged_attention.STORE_IN_KERNEL``) alternating in one process (each a fresh patch).

python notes/results/session21/s21_d.py REPS
As examples/bench_fp8_kv.py's nano workload (same prompts, warm-up and timed run), Qwen3-0.6B, fp8 only.
"""

import importlib
import sys

import torch

sys.path.insert(0, "examples")
import bench_fp8_kv as bench  # noqa: E402

import hfpaged  # noqa: E402

pa_module = importlib.import_module("hfpaged.kernels.paged_attention")


def main():
    reps = int(sys.argv[1])
    model = bench.build_model("qwen3-0.6b", torch.bfloat16)
    prompts, out_lens = bench.workload("nano", 256, model.config.vocab_size)
    block_bytes = 16 * bench.kv_bytes_per_token(model, "fp8")
    for rep in range(reps):
        for fused in (False, True):
            pa_module.STORE_IN_KERNEL = fused
            hfpaged.patch(model, num_blocks=int(8 * 2**30) // block_bytes, kv_cache_dtype="fp8")
            short = [p[:256] for p in prompts[:8]]
            model.generate_many(short, max_new_tokens=32, do_sample=False)
            model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
            hfpaged.reset_prefix_cache(model)
            entry = bench.run(model, prompts, out_lens)
            hfpaged.unpatch(model)
            torch.cuda.empty_cache()
            print(f"rep {rep} STORE_IN_KERNEL={fused}: fp8 nano {entry['output_tokens_per_s']:,.0f} out tok/s, "
                  f"{entry['steps']} steps, {entry['num_preemptions']} preemptions, max running "
                  f"{entry['max_running']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
