"""Probe A (session 19): decode attention at batch 256 and short contexts (the chat shape), kernel alone.

python notes/results/session19/s19_a.py OUT.json [--dry-run]
B=256 decode over contexts 64..1024 (uniform) and a chat-like mix (U[272, 400]), Qwen3-0.6B heads (16/8 x 128) and
Llama-3.2-1B heads (32/8 x 64), bf16: the default config with and without the one-query program map, other tiles,
blocks shuffled (bench_kernels' layout) and in order (the engine's, mostly), PDL on/off. CUDA-graph timing.
"""

import dataclasses
import json
import sys
import time

sys.path.insert(0, "examples")
import bench_kernels as bk  # noqa: E402
import torch  # noqa: E402

from hfpaged.kernels.paged_attention import config_for_batch, paged_attention_with_config  # noqa: E402

DRY = "--dry-run" in sys.argv
bk.DEVICE = "cpu" if DRY else "cuda"
DEV = "cpu" if DRY else "cuda"
DT = torch.float16 if DRY else torch.bfloat16
BATCH = 8 if DRY else 256
TILES = [(64, 4, 2), (32, 4, 2), (128, 4, 2), (64, 4, 3), (32, 2, 2), (64, 8, 2), (16, 4, 2), (32, 4, 3)]


def problem(heads, kv_heads, hd, lens, shuffled, sets):
    blocks_per_seq = [(n + 15) // 16 for n in lens]
    width = max(blocks_per_seq)
    per_set = sum(blocks_per_seq)
    total = per_set * sets
    k = torch.randn(total, 16, kv_heads, hd, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    ids = torch.randperm(total) if shuffled else torch.arange(total)
    tables, qs = [], []
    for s in range(sets):
        t = torch.zeros(len(lens), width, dtype=torch.int32)
        at = s * per_set
        for b, nb in enumerate(blocks_per_seq):
            t[b, :nb] = ids[at : at + nb].to(torch.int32)
            at += nb
        tables.append(t.to(DEV))
        qs.append(torch.randn(len(lens), heads, hd, device=DEV, dtype=DT))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    return k, v, tables, qs, seq_lens, cu


def main():
    out_path = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    rows = []
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    for heads, kv_heads, hd in ((16, 8, 128), (32, 8, 64)):
        kv_bytes_per_token = kv_heads * hd * 2 * 2
        contexts = [("u", c) for c in ((64, 320) if DRY else (64, 128, 256, 320, 512, 1024))] + [("chat", 0)]
        for kind, ctx in contexts:
            lens = [ctx] * BATCH if kind == "u" else torch.randint(272, 401, (BATCH,), generator=gen).tolist()
            tokens = sum(lens)
            sets = max(1, min(64, (256 << 20) // (tokens * kv_bytes_per_token))) if not DRY else 1
            for shuffled in (True, False):
                k, v, tables, qs, seq_lens, cu = problem(heads, kv_heads, hd, lens, shuffled, sets)
                default = config_for_batch(BATCH, BATCH, heads, DT, k, v, 1, max(lens))
                variants = [("default", default, False), ("default_lookup", dataclasses.replace(default, one_query=False), False)]
                if not DRY:
                    variants.append(("default_pdl", default, True))
                if shuffled is False:
                    for tile_n, w, st in TILES[1:] if not DRY else TILES[1:2]:
                        variants.append((f"{tile_n}/{w}/{st}", dataclasses.replace(default, tile_n=tile_n, num_warps=w, num_stages=st), False))
                ref = None
                for name, config, pdl in variants:
                    def make(i, config=config, pdl=pdl):
                        return lambda: paged_attention_with_config(
                            qs[i], k, v, tables[i], seq_lens, cu, scale=hd**-0.5, config=config, launch_pdl=pdl)
                    try:
                        out0 = make(0)()
                        if ref is None:
                            ref = out0.float()
                        diff = float((out0.float() - ref).abs().max())
                        ms = bk.graph_time_ms([make(i) for i in range(sets)])
                    except Exception as exc:
                        print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                        continue
                    gbs = tokens * kv_bytes_per_token / ms / 1e6
                    row = dict(heads=f"{heads}/{kv_heads}x{hd}", kind=kind, context=ctx if kind == "u" else "U[272,400]",
                               shuffled=shuffled, variant=name, us=ms * 1e3, gbs=gbs, diff=diff,
                               config=dataclasses.asdict(config))
                    rows.append(row)
                    print(f"{row['heads']} {kind} ctx={row['context']} {'shuf' if shuffled else 'order'} {name:15s} "
                          f"{ms * 1e3:8.1f} us {gbs:6.0f} GB/s diff {diff:.2g}", flush=True)
                del k, v, tables, qs
                if not DRY:
                    torch.cuda.empty_cache()
    json.dump(dict(rows=rows, elapsed_s=time.time() - t0, device=str(torch.cuda.get_device_name()) if not DRY else "cpu"),
              open(out_path, "w"), indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
