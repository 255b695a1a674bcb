"""Session 26 probe A: fp8 x fp8 decode dots (AttentionConfig.fp8_mma) against today's fp16-dot fp8 tile.

Phase 1, kernel alone (Qwen3 heads 16/8 x 128, block 16, one query per sequence, shuffled blocks, CUDA-graph timing
as sweep_fp8_decode.py): bf16 cache with today's config; e4m3 with today's (FP8_MMA_TILE = None); e4m3 with fp8 MMAs
at several tiles. Each output against a float64 reference (max |error| / max |reference|).
Phase 2, engine (unless --kernels-only): Qwen3-0.6B shape, nano-vllm workload, 8 GiB pool: bf16, then fp8 with the
MMAs off / on alternating (fresh patch each), output tok/s and the greedy tokens' agreement between off and on.

    python notes/results/session26/s26_a.py OUT_DIR [--dry-run] [--kernels-only] [--slot-minor]

--slot-minor (call 4): also V stored slot-minor ([blocks, kv_heads, D, block_size], a strided view for the kernel),
today's tile and fp8-MMA tiles on it; the kernel is commit 1841fa3's with FP8_MMA as a level (2: both dots).
"""

import dataclasses
import json
import math
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, "tests")
    import interpreter_fp8

    interpreter_fp8.install()
sys.path.insert(0, "examples")

import torch  # noqa: E402

import sweep_fp8_decode as sweep  # noqa: E402
from hfpaged.kernels import attention_config as ac  # noqa: E402
from hfpaged.kernels.paged_attention import config_for_batch, paged_attention_with_config  # noqa: E402
from hfpaged.kernels.reference import paged_attention_reference  # noqa: E402

H, KVH, D, BS = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn
TILES = [(64, 4, 2)] if "--slot-minor" in sys.argv else [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2)]
SLOT_TILES = [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2)] if "--slot-minor" in sys.argv else []
if DRY:
    TILES, SLOT_TILES = [(32, 4, 2)], [(32, 4, 2)]


def slot_minor(v):
    """The same V values stored [blocks, kv_heads, D, block_size] (keys of a block contiguous), viewed as the
    kernel's [blocks, block_size, kv_heads, D]: K-major for P.V, so fp8 tiles can feed wgmma without a transpose."""
    return v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def problem(lens, kv_dtype, device, sets, q_dtype):
    blocks = [math.ceil(n / BS) for n in lens]
    total = sum(blocks) * sets
    shape = (total, BS, KVH, D)
    if kv_dtype == FP8:
        k = (torch.randn(shape, device=device) * 64).clamp(-448, 448).to(FP8)
        v = (torch.randn(shape, device=device) * 64).clamp(-448, 448).to(FP8)
        scale = torch.full((1,), 1 / 64, device=device)
    else:
        k = torch.randn(shape, device=device, dtype=kv_dtype)
        v = torch.randn(shape, device=device, dtype=kv_dtype)
        scale = None
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables, start = [], 0
    for _ in range(sets):
        t = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=device)
        for i, b in enumerate(blocks):
            t[i, :b] = perm[start : start + b]
            start += b
        tables.append(t)
    qs = [(torch.randn(len(lens), H, D, device=device) * 3).to(torch.bfloat16).to(q_dtype) for _ in range(sets)]
    return k, v, scale, tables, qs


def kernels(out_dir, device):
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "nano mid B=256": lambda: (torch.randint(100, 1025, (256,), generator=gen) + 300).tolist(),
        "nano late B=256": lambda: (torch.randint(100, 1025, (256,), generator=gen)
                                    + torch.randint(0, 1025, (256,), generator=gen)).tolist(),
        "nano mid B=128": lambda: (torch.randint(100, 1025, (128,), generator=gen) + 300).tolist(),
        "256 x 512": lambda: [512] * 256,
        "256 x 1024": lambda: [1024] * 256,
        "256 x 2048": lambda: [2048] * 256,
        "64 x 4096": lambda: [4096] * 64,
        "24 x 6144": lambda: [6144] * 24,
        "chat B=256": lambda: (torch.randint(32, 513, (256,), generator=gen) + 64).tolist(),
    }  # fmt: skip
    if DRY:
        shapes = {"dry": lambda: [40, 70, 10, 90, 33, 64]}
    q_dtype = torch.float16 if DRY else torch.bfloat16
    rows = []
    for name, draw in shapes.items():
        lens = draw()
        batch = len(lens)
        row = dict(shape=name, batch=batch, keys=sum(lens))
        for kind, kv in (("bf16", q_dtype), ("e4m3", FP8)):
            sets = 1 if DRY else max(1, min(16, math.ceil((256 << 20) / (sum(lens) * KVH * D * 2 * kv.itemsize))))
            k, v, scale, tables, qs = problem(lens, kv, device, sets, q_dtype)
            sl = torch.tensor(lens, dtype=torch.int32, device=device)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
            saved = ac.FP8_MMA_TILE
            ac.FP8_MMA_TILE = None
            base = config_for_batch(batch, batch, H, q_dtype, k, v, 1, max(lens))
            ac.FP8_MMA_TILE = saved
            variants = {"today": base}
            if kind == "e4m3":
                for tile in TILES:
                    variants[f"mma {tile}"] = dataclasses.replace(
                        base, block_m=64, tile_n=tile[0], num_warps=tile[1], num_stages=tile[2], fp8_mma=2
                    )
                variants["slot-minor V today"] = base
                for tile in SLOT_TILES:
                    variants[f"slot-minor V mma {tile}"] = dataclasses.replace(
                        base, block_m=64, tile_n=tile[0], num_warps=tile[1], num_stages=tile[2], fp8_mma=2
                    )
            v_slot = slot_minor(v) if kind == "e4m3" else None
            ref = paged_attention_reference(qs[0].double(), k, v, tables[0], sl, cu, scale=D**-0.5,
                                            k_scale=scale, v_scale=scale)  # fmt: skip
            for vname, cfg in variants.items():
                vv = v_slot if vname.startswith("slot-minor") else v
                calls = [
                    lambda t=t, q=q, cfg=cfg, vv=vv: paged_attention_with_config(
                        q, k, vv, t, sl, cu, scale=D**-0.5, config=cfg, k_scale=scale, v_scale=scale
                    )
                    for t, q in zip(tables, qs)
                ]
                out = calls[0]()
                err = float((out.double() - ref).abs().max() / ref.abs().max())
                us = sweep.graph_time_ms(calls, device) * 1e3 if not DRY else 0.0
                tbs = sum(lens) * KVH * D * 2 * kv.itemsize / (us * 1e6) if us else 0.0
                row[f"{kind} {vname}"] = dict(us=us, tb_s=tbs, rel_err=err, config=dataclasses.asdict(cfg))
                print(f"{name:16s} {kind} {vname:18s} {us:8.1f} us {tbs:5.2f} TB/s  rel err {err:.2e}", flush=True)
            del k, v, v_slot, tables, qs
            if not DRY:
                torch.cuda.empty_cache()
        rows.append(row)
        with open(os.path.join(out_dir, "s26_a_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def best_tile(rows, tiles=None, prefix="e4m3 mma"):
    scores = {}
    for tile in tiles if tiles is not None else TILES:
        key = f"{prefix} {tile}"
        r = [row["e4m3 today"]["us"] / row[key]["us"] for row in rows if row["batch"] >= 128 and row[key]["us"]]
        scores[tile] = math.exp(sum(map(math.log, r)) / len(r)) if r else 0.0
    print("speed-up over today's e4m3 tile, geometric mean over batch >= 128:", scores, flush=True)
    return max(scores, key=scores.get), scores


def engine(out_dir, tile):
    import benchmark  # examples/benchmark.py
    from bench_fp8_kv import kv_bytes_per_token, run

    import hfpaged

    model = benchmark.build_model("qwen3-0.6b", torch.bfloat16)
    prompts, out_lens = benchmark.workload("nano", 256, model.config.vocab_size)
    results, tokens = [], {}
    plan = [("auto", None), ("fp8", None), ("fp8", tile), ("fp8", None), ("fp8", tile)]
    for kv, mma in plan:
        ac.FP8_MMA_TILE = mma
        block_bytes = 16 * kv_bytes_per_token(model, kv)
        hfpaged.patch(model, num_blocks=int(8 * 2**30) // block_bytes, kv_cache_dtype=kv)
        short = [p[:256] for p in prompts[:8]]
        t0 = time.perf_counter()
        model.generate_many(short, max_new_tokens=32, do_sample=False)
        model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
        warm = time.perf_counter() - t0
        hfpaged.reset_prefix_cache(model)
        entry = run(model, prompts, out_lens)
        entry.update(kv=kv, fp8_mma_tile=mma, warmup_s=warm)
        got = [r.token_ids for r in model.generate_many(prompts[:32], max_new_tokens=64, do_sample=False)]
        tokens.setdefault((kv, mma), got)
        results.append(entry)
        print("engine", kv, mma, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}),
              flush=True)  # fmt: skip
        hfpaged.unpatch(model)
        torch.cuda.empty_cache()
        with open(os.path.join(out_dir, "s26_a_engine.json"), "w") as f:
            json.dump(results, f, indent=1)
    off, on = tokens[("fp8", None)], tokens[("fp8", tile)]
    same = sum(a == b for a, b in zip(off, on))
    print(f"greedy 64 tokens of 32 nano prompts, fp8 MMAs off vs on: {same} of {len(off)} identical", flush=True)
    return results


def main():
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    os.makedirs(out_dir, exist_ok=True)
    device = "cpu" if DRY else "cuda"
    torch.manual_seed(0)
    rows = kernels(out_dir, device)
    if SLOT_TILES and not DRY:
        best_tile(rows, SLOT_TILES, "e4m3 slot-minor V mma")
    if DRY or "--kernels-only" in sys.argv:
        return
    tile, _ = best_tile(rows)
    engine(out_dir, tile)


if __name__ == "__main__":
    main()
