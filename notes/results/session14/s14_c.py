"""Session 14 probe C: decode attention over (num_splits, min_split_tiles) on variable-length contexts (the kernel
with a minimum of tiles per split: splits past a short context's keys are empty and exit early). Head shapes of
Qwen3-0.6B (16/8 x 128), Llama-3.2-1B (32/8 x 64), Llama-3.1-8B (32/8 x 128); bf16 queries, bf16 and fp8 caches
with their default tiles. A batch is padded to its decode graph bucket (batch 1 -> the 2-row graph, as the engine
does under compile) with 1-token padding sequences. Graph-timed with dependent launch (20 calls per graph)."""

import json
import os

import torch

from hfpaged.kernels.attention_config import AttentionConfig, choose_config
from hfpaged.kernels.paged_attention import paged_attention_with_config

OUT = os.environ.get("OUT", ".")
BS = 16
dev = torch.device("cuda")
res = []
HEADS = {"qwen3": (16, 8, 128), "llama1b": (32, 8, 64), "llama8b": (32, 8, 128)}


def bucket(b):
    return 2 if b <= 2 else (4 if b <= 4 else -(-b // 8) * 8)


def case(name, heads, real, lo, hi, kv, splits, min_tiles, seed=0):
    H, KVH, D = HEADS[heads]
    g = torch.Generator().manual_seed(seed)
    B = bucket(real)
    ctx = torch.randint(lo, hi + 1, (real,), generator=g).tolist() + [1] * (B - real)
    blocks_per = [-(-c // BS) for c in ctx]
    total = sum(blocks_per)
    perm = torch.randperm(total, generator=g).to(torch.int32)
    table = torch.zeros(B, max(blocks_per), dtype=torch.int32)
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
    base = choose_config(num_tokens=B, num_seqs=B, num_kv_heads=KVH, group=H // KVH, head_dim_pad=D, elem_size=2,
                         kv_elem_size=dt.itemsize, max_seqlen_q=1, max_seqlen_k=40960, device=dev)
    row = {"name": name, "heads": heads, "kv": kv, "real": real, "bucket": B, "ctx": [lo, hi],
           "default_splits": base.num_splits, "tile": [base.tile_n, base.num_warps, base.num_stages], "us": {}}
    kv_bytes = sum(ctx[:real]) * KVH * D * 2 * dt.itemsize
    ref = None
    best = None
    for s in sorted(set(splits + [base.num_splits])):
        for mt in (min_tiles if s > 1 else [1]):
            cfg = AttentionConfig(base.block_m, base.tile_n, base.num_warps, base.num_stages, s, mt)
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
            for _ in range(7):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) / 20 * 1e3)
            us = sorted(times)[3]
            row["us"][f"{s}/{mt}"] = us
            if best is None or us < best[0]:
                best = (us, s, mt)
            tag = "*" if (s == base.num_splits and mt == 1) else " "
            print(f"{name:6} {heads:7} {kv:4} B={real:3}/{B:3} ctx {lo:5}-{hi:5} S={s:2} mt={mt:2}{tag} {us:7.1f} us "
                  f"{kv_bytes / us / 1e3:6.0f} GB/s err {err:.3g}", flush=True)
            assert err < 0.1, err
            del graph
    print(f"BEST {name} {heads} {kv} B={real} ctx {lo}-{hi}: S={best[1]} mt={best[2]} {best[0]:.1f} us "
          f"(default S={base.num_splits}: {row['us'][f'{base.num_splits}/1']:.1f} us)", flush=True)
    res.append(row)
    json.dump(res, open(os.path.join(OUT, "s14_c.json"), "w"), indent=1)


for heads in ("qwen3", "llama1b", "llama8b"):
    for c in (128, 384, 1024, 4096):
        case("b1", heads, 1, c, c, "bf16", [4, 8, 17, 33, 64], [1, 2, 4])
case("b4", "qwen3", 4, 1024, 4096, "bf16", [4, 8, 17, 33, 64], [1, 2, 4, 8])
for kv, real in (("bf16", 12), ("fp8", 24)):
    case("long", "qwen3", real, 4352, 8704, kv, [2, 3, 4, 6, 8, 12, 16, 24, 32], [1, 4, 8, 16])
for kv in ("bf16", "fp8"):
    for real in (8, 16, 32):
        case("nano", "qwen3", real, 200, 2048, kv, [1, 2, 3, 4, 8, 16, 33], [1, 2, 4, 8])
