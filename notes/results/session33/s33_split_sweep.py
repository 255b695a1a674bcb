"""Session 33 probe: context splits for the CUDA fp8 decode kernel at mid-size batches (issue 16).

    python notes/results/session33/s33_split_sweep.py [--out DIR]

For decode batches of 6-64 sequences (long-prompt workload: 4-8.7k keys; nano tail: 300-1.4k; chat: 64-600),
times the CUDA kernel (kernels/fp8_decode.py, through paged_attention_with_config) at split counts 1-24 and
minimum split sizes of 128 and 512 keys, next to what choose_config picks today (the Triton-tuned mid-batch rule)
for the CUDA and the Triton kernel. CUDA graphs of 10 calls, median of 20 replays. TB/s counts the fp8 K/V bytes.
Every split output is compared with the unsplit one.
"""

import argparse
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.getcwd())
import hfpaged.kernels.fp8_decode as fd  # noqa: E402
import hfpaged.kernels.paged_attention  # noqa: E402
from hfpaged.kernels.attention_config import AttentionConfig  # noqa: E402

pa = sys.modules["hfpaged.kernels.paged_attention"]
sys.path.insert(0, os.path.join(os.getcwd(), "notes/results/session32"))
from s32_fp8dec import make_problem, time_graph  # noqa: E402

DEV = "cuda"


def run(p, scale, config, use_cuda):
    fd.USE_CUDA_FP8_DECODE = use_cuda
    B = p["q"].shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    if config is None:
        return pa.paged_attention(p["q"], p["k_cache"], p["v_cache"], p["tables"], p["seq_lens"], cu, scale=scale,
                                  max_seqlen_q=1, max_seqlen_k=p["max_k"], k_scale=p["k_scale"],
                                  v_scale=p["v_scale"])  # fmt: skip
    return pa.paged_attention_with_config(p["q"], p["k_cache"], p["v_cache"], p["tables"], p["seq_lens"], cu,
                                          scale=scale, config=config, k_scale=p["k_scale"],
                                          v_scale=p["v_scale"])  # fmt: skip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    logf = open(os.path.join(a.out, "s33_split_sweep.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    log(f"device {torch.cuda.get_device_name()} sms {torch.cuda.get_device_properties(0).multi_processor_count}")
    rng = random.Random(3)
    shapes = {}
    for b in (6, 12, 18, 25, 32, 48):
        shapes[f"long_{b}"] = [rng.randint(4096, 8192) + rng.randint(0, 512) for _ in range(b)]
    for b in (8, 16, 24, 32, 64):
        shapes[f"nano_{b}"] = [rng.randint(100, 1024) + rng.randint(200, 400) for _ in range(b)]
    for b in (16, 32):
        shapes[f"chat_{b}"] = [rng.randint(32, 512) + 64 for _ in range(b)]
    heads = {"qwen3": (16, 8, 128), "llama1b": (32, 8, 64)}
    rows = []
    for hname, (H, KVH, D) in heads.items():
        for sname, lens in shapes.items():
            if hname == "llama1b" and sname not in ("long_12", "long_25", "nano_16", "nano_32"):
                continue
            p = make_problem(lens, H, KVH, D, 16, torch.float8_e4m3fn, torch.bfloat16, seed=7, nan_fill=False)
            scale = D**-0.5
            kv_bytes = sum(lens) * KVH * D * 2
            cfg = pa.config_for_batch(len(lens), len(lens), H, torch.bfloat16, p["k_cache"], p["v_cache"], 1, p["max_k"])
            row = dict(heads=hname, shape=sname, batch=len(lens), mean_len=sum(lens) / len(lens), max_len=max(lens),
                       default=[cfg.num_splits, cfg.min_split_tiles * cfg.tile_n, cfg.split_target_programs])  # fmt: skip
            row["triton_default_us"] = time_graph(lambda: run(p, scale, None, False))
            row["cuda_default_us"] = time_graph(lambda: run(p, scale, None, True))
            ref = run(p, scale, AttentionConfig(16, 128, 4, 2, 1, 1, 0, True), True).float()
            worst = 0.0
            for min_keys in (128, 512):
                for s in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24):
                    if s == 1 and min_keys == 512:
                        continue
                    c = AttentionConfig(16, 128, 4, 2, s, min_keys // 128, 0, True)
                    out = run(p, scale, c, True).float()
                    worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
                    row[f"s{s}_m{min_keys}_us"] = time_graph(lambda c=c: run(p, scale, c, True))
            row["worst_rel_vs_unsplit"] = worst
            best = min((v, k) for k, v in row.items() if k.startswith("s") and k.endswith("_us"))
            row["best"] = best[1]
            row["best_us"] = best[0]
            row["best_tbs"] = kv_bytes / best[0] / 1e6
            row["cuda_default_tbs"] = kv_bytes / row["cuda_default_us"] / 1e6
            row["default_over_best"] = row["cuda_default_us"] / best[0]
            log(json.dumps(row))
            rows.append(row)
            del p
            torch.cuda.empty_cache()
    with open(os.path.join(a.out, "s33_split_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
