"""Session 24 probe C: does the order of a decode batch's sequences cost the attention kernel a tail?

Decode programs map to sequences in batch order (program i = sequence i, per KV head). With contexts of mixed
lengths (nano: prompts and outputs of 100-1,024 tokens) the last programs to start may be long ones, leaving SMs
idle at the end. Here: one decode batch (Qwen3 heads 16/8 x 128, block 16, one query per sequence, the config the
engine would choose), contexts drawn from a distribution, timed with the sequences in random order, sorted longest
first and shortest first (same keys, same bytes); bf16 and e4m3 caches. CUDA-graph timing as sweep_fp8_decode.py.

    python notes/results/session24/s24_c.py OUT_DIR [--dry-run]
"""

import dataclasses
import json
import math
import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "examples")

import torch  # noqa: E402

import sweep_fp8_decode as sweep  # noqa: E402
from hfpaged.kernels.attention_config import choose_config  # noqa: E402

H, KVH, D, BS = 16, 8, 128, 16
FP8 = torch.float8_e4m3fn


def problem(lens, kv_dtype, device, sets):
    """Caches holding every sequence's blocks (shuffled), per set; q per set."""
    batch = len(lens)
    blocks = [math.ceil(n / BS) for n in lens]
    total = sum(blocks) * sets
    shape = (total, BS, KVH, D)
    if kv_dtype == FP8:
        k = (torch.randn(shape, device=device, dtype=torch.bfloat16) * 64).clamp(-448, 448).to(FP8)
        v = (torch.randn(shape, device=device, dtype=torch.bfloat16) * 64).clamp(-448, 448).to(FP8)
        scale = torch.full((1,), 1 / 64, device=device)
    else:
        k = torch.randn(shape, device=device, dtype=kv_dtype)
        v = torch.randn(shape, device=device, dtype=kv_dtype)
        scale = None
    perm = torch.randperm(total, device=device).to(torch.int32)
    width = max(blocks)
    tables, start = [], 0
    for _ in range(sets):
        t = torch.zeros(batch, width, dtype=torch.int32, device=device)
        for i, b in enumerate(blocks):
            t[i, :b] = perm[start : start + b]
            start += b
        tables.append(t)
    q_dtype = torch.bfloat16 if not DRY else torch.float16
    qs = [torch.randn(batch, H, D, device=device, dtype=q_dtype) for _ in range(sets)]
    return k, v, scale, tables, qs


def main():
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    os.makedirs(out_dir, exist_ok=True)
    device = "cpu" if DRY else "cuda"
    gen = torch.Generator().manual_seed(0)
    dists = {
        "nano mid-run (prompt U[100,1024] + 300 generated)": lambda b: (torch.randint(100, 1025, (b,), generator=gen) + 300),
        "nano late (prompt U[100,1024] + U[0,1024] generated)": lambda b: (torch.randint(100, 1025, (b,), generator=gen) + torch.randint(0, 1025, (b,), generator=gen)),
        "chat (prompt U[32,512] + 64)": lambda b: (torch.randint(32, 513, (b,), generator=gen) + 64),
    }  # fmt: skip
    batches = (256, 128) if not DRY else (6,)
    results = []
    for kind, kv in (("bf16", torch.bfloat16 if not DRY else torch.float16), ("e4m3", FP8)):
        for name, draw in dists.items():
            for batch in batches:
                lens = draw(batch).tolist() if not DRY else [40, 70, 10, 90, 33, 64]
                sets = 1 if DRY else max(1, min(16, math.ceil((256 << 20) / (sum(lens) * KVH * D * 2 * kv.itemsize))))
                k, v, scale, tables, qs = problem(lens, kv, device, sets)
                config = choose_config(num_tokens=batch, num_seqs=batch, num_kv_heads=KVH, group=H // KVH,
                                       head_dim_pad=D, elem_size=2, max_seqlen_q=1, max_seqlen_k=max(lens),
                                       device=torch.device(device), kv_elem_size=kv.itemsize)  # fmt: skip
                row = dict(kv=kind, dist=name, batch=batch, keys=sum(lens), config=dataclasses.asdict(config))
                outs = {}
                for order_name in ("batch order", "longest first", "shortest first"):
                    idx = list(range(batch))
                    if order_name != "batch order":
                        idx.sort(key=lambda i: lens[i], reverse=order_name == "longest first")
                    ix = torch.tensor(idx, device=device)
                    sl = torch.tensor([lens[i] for i in idx], dtype=torch.int32, device=device)
                    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
                    calls = []
                    for s in range(sets):
                        t, q = tables[s][ix].contiguous(), qs[s][ix].contiguous()
                        calls.append(lambda t=t, q=q: sweep.paged_attention_with_config(
                            q, k, v, t, sl, cu, scale=D**-0.5, config=config, k_scale=scale, v_scale=scale))  # fmt: skip
                    out = calls[0]()
                    inv = torch.empty_like(ix)
                    inv[ix] = torch.arange(batch, device=device)
                    outs[order_name] = out[inv].float()
                    ms = sweep.graph_time_ms(calls, device)
                    row[order_name] = ms * 1e3
                base = outs["batch order"]
                row["outputs_equal"] = all(bool(torch.equal(base, o)) for o in outs.values())
                results.append(row)
                gbs = row["keys"] * KVH * D * 2 * kv.itemsize / (row["batch order"] * 1e3)
                print(f"{kind} {name} B={batch}: batch order {row['batch order']:.1f} us ({gbs:.0f} GB/s), longest first "
                      f"{row['longest first']:.1f}, shortest first {row['shortest first']:.1f}; outputs equal "
                      f"{row['outputs_equal']}; config {config}", flush=True)  # fmt: skip
                with open(os.path.join(out_dir, "s24_c.json"), "w") as f:
                    json.dump(results, f, indent=1)
                del k, v, tables, qs
                if not DRY:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
