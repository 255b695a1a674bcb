"""Session 14 probe A: decode attention vs the number of context splits, on variable-length contexts as the engine
sees them (Qwen3-0.6B heads 16/8 x 128, block 16, bf16 queries; bf16 and fp8 e4m3 caches, each with its default
tile). Graph-timed (CUDA graph of 20 calls, median of 5 replays). A batch is padded to its decode graph bucket
with 1-token padding sequences, as InputBatch.pack does."""

import json
import os
import sys

import torch

from hfpaged.kernels.attention_config import choose_config, AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config

OUT = os.environ.get("OUT", ".")
H, KVH, D, BS = 16, 8, 128, 16
dev = torch.device("cuda")
res = []


def bucket(b):
    return b if b in (1, 2, 4) else -(-b // 8) * 8


def case(name, real, lo, hi, kv, splits_list, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = bucket(real)
    ctx = torch.randint(lo, hi + 1, (real,), generator=g).tolist() + [1] * (B - real)
    blocks_per = [-(-c // BS) for c in ctx]
    width = max(blocks_per)
    total = sum(blocks_per)
    perm = torch.randperm(total, generator=g).to(torch.int32)
    table = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks_per):
        table[i, :n] = perm[at : at + n]
        at += n
    table = table.to(dev)
    seq_lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
    q = torch.randn(B, H, D, dtype=torch.bfloat16, device=dev)
    dt = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    k = (torch.randn(total, BS, KVH, D, device=dev) * 4).to(dt)
    v = (torch.randn(total, BS, KVH, D, device=dev) * 4).to(dt)
    extra = {} if kv == "bf16" else {"k_scale": torch.ones(1, device=dev), "v_scale": torch.ones(1, device=dev)}
    base = choose_config(num_tokens=B, num_seqs=B, num_kv_heads=KVH, group=2, head_dim_pad=128, elem_size=2,
                         kv_elem_size=dt.itemsize, max_seqlen_q=1, max_seqlen_k=40960, device=dev)
    ref = None
    row = {"name": name, "kv": kv, "real": real, "bucket": B, "ctx": [lo, hi], "default_splits": base.num_splits,
           "tile": [base.tile_n, base.num_warps, base.num_stages], "us": {}}
    kv_bytes = sum(ctx[:real]) * KVH * D * 2 * dt.itemsize
    for s in sorted(set(splits_list + [base.num_splits])):
        cfg = AttentionConfig(base.block_m, base.tile_n, base.num_warps, base.num_stages, s)
        out = torch.empty(B, H, D, dtype=torch.bfloat16, device=dev)

        def call():
            paged_attention_with_config(q, k, v, table, seq_lens, cu, scale=0.088, config=cfg, out=out,
                                        launch_pdl=True, **extra)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float().clone()
        err = (out.float() - ref)[:real].abs().max().item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(20):
                call()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 20 * 1e3)
        us = sorted(times)[2]
        row["us"][s] = us
        print(f"{name:10} {kv:4} B={real:3}/{B:3} ctx {lo}-{hi} splits {s:2}{'*' if s == base.num_splits else ' '} "
              f"{us:8.1f} us {kv_bytes / us / 1e3:7.0f} GB/s err {err:.3g}", flush=True)
        del graph
    res.append(row)
    json.dump(res, open(os.path.join(OUT, "s14_a.json"), "w"), indent=1)


S = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
# long-prompt workload (pool 8 GiB): bf16 ~12 sequences at once, fp8 ~24; contexts 4k-8k prompt + up to 512 new
for kv, real in (("bf16", 12), ("fp8", 24), ("bf16", 11), ("fp8", 23)):
    case("long", real, 4352, 8704, kv, S)
# uniform long contexts (the kernel benchmark's shape) for reference
for kv, real in (("bf16", 12), ("fp8", 24)):
    case("long_eq", real, 6144, 6144, kv, S)
# nano-like: contexts 200-2048
for kv in ("bf16", "fp8"):
    for real in (16, 32, 64, 131, 256):
        case("nano", real, 200, 2048, kv, [1, 2, 3, 4, 6, 8, 12, 16] if real <= 64 else [1, 2, 3, 4])
# batch 1-4 latency shapes
for kv in ("bf16",):
    for real, ctx in ((1, 300), (1, 1024), (2, 1024), (4, 4096)):
        case("small", real, ctx, ctx, kv, [1, 4, 8, 16, 24, 33, 48, 64])
