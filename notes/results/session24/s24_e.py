"""Probe E (session 24): bf16 decode attention at short contexts with a register cap, kernel alone, then in the
engine on the chat workload.

Session 22's chat profile spent 3.60 ms of a 5.04 ms decode step in attention (247 rows of ~336 keys: ~2.65 TB/s);
probe C's kernel alone gave the same (chat contexts, B=256: 128.1 us per layer, 2.76 TB/s) against 2.87-2.96 at
longer contexts. The bf16 decode variant has 112 registers (4 CTAs of 4 warps per SM); a cap of 96 gives 5, 80 gives
6. A cap changes no arithmetic (outputs bitwise equal, checked). Kernel phase: mixed-length batches (chat, nano) and
uniform ones, bf16 (64, 4, 2) and (32, 4, 2) x caps. Engine phase (--engine): if a cap on today's tile beats it by
>= 2% on the chat shapes, Qwen3-0.6B and Llama-3.2-1B chat (benchmark.timed_runs: median of 3 on a reset prefix
cache) with and without it, alternating, fresh patch each; greedy tokens compared (must be equal: same arithmetic).

    python notes/results/session24/s24_e.py OUT_DIR [--engine] [--dry-run]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, "examples")

import torch  # noqa: E402

import s24_a  # noqa: E402  (its kernel wrapper applies the caps)
import s24_c  # noqa: E402  (mixed-length decode batches)
import sweep_fp8_decode as sweep  # noqa: E402
from hfpaged.kernels import attention_config  # noqa: E402
from hfpaged.kernels.attention_config import choose_config  # noqa: E402

VARIANTS = [((64, 4, 2), None), ((64, 4, 2), 104), ((64, 4, 2), 96), ((64, 4, 2), 88), ((64, 4, 2), 80),
            ((32, 4, 2), None), ((32, 4, 2), 80), ((32, 4, 2), 64), ((64, 4, 3), 96)]  # fmt: skip
if DRY:
    VARIANTS = [((32, 4, 2), None), ((32, 4, 2), 64)]
KVH, D = 8, 128


def kernel_phase(out_dir):
    device = "cpu" if DRY else "cuda"
    kv = torch.bfloat16 if not DRY else torch.float16
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "chat B=256": lambda: (torch.randint(32, 513, (256,), generator=gen) + 64).tolist(),
        "chat B=247 late": lambda: (torch.randint(32, 513, (247,), generator=gen) + 120).tolist(),
        "chat B=128": lambda: (torch.randint(32, 513, (128,), generator=gen) + 64).tolist(),
        "nano B=256": lambda: (torch.randint(100, 1025, (256,), generator=gen) + 300).tolist(),
        "uniform 256 x 1024": lambda: [1024] * 256,
    }
    if DRY:
        shapes = {"dry": lambda: [40, 70, 10, 90, 33, 64]}
    results = []
    for name, draw in shapes.items():
        lens = draw()
        batch = len(lens)
        sets = 1 if DRY else max(1, min(16, math.ceil((256 << 20) / (sum(lens) * KVH * D * 2 * kv.itemsize))))
        k, v, scale, tables, qs = s24_c.problem(lens, kv, device, sets)
        sl = torch.tensor(lens, dtype=torch.int32, device=device)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        base = choose_config(num_tokens=batch, num_seqs=batch, num_kv_heads=KVH, group=2, head_dim_pad=D, elem_size=2,
                             max_seqlen_q=1, max_seqlen_k=max(lens), device=torch.device(device))  # fmt: skip
        row = dict(shape=name, batch=batch, keys=sum(lens), base=dataclasses.asdict(base), variants=[])
        ref = None
        for tile, cap in VARIANTS:
            config = dataclasses.replace(base, tile_n=tile[0], num_warps=tile[1], num_stages=tile[2])
            s24_a.CAPPED.rule = (False, tile, cap)
            calls = [
                lambda t=tables[s], q=qs[s]: sweep.paged_attention_with_config(
                    q, k, v, t, sl, cu, scale=D**-0.5, config=config, k_scale=scale, v_scale=scale)
                for s in range(sets)
            ]  # fmt: skip
            out = calls[0]().clone()
            entry = dict(tile=tile, maxnreg=cap)
            compiled = s24_a.CAPPED.last
            if compiled is not None and not DRY:
                compiled._init_handles()
                entry.update(regs=compiled.n_regs, spills=compiled.n_spills)
            if tile == VARIANTS[0][0] and cap is None:
                ref = out
            entry["bitwise_equal_to_uncapped"] = bool(torch.equal(out, ref)) if tile == VARIANTS[0][0] else None
            ms = sweep.graph_time_ms(calls, device)
            s24_a.CAPPED.rule = None
            entry["us"] = ms * 1e3
            entry["tbs"] = sum(lens) * KVH * D * 2 * kv.itemsize / (ms * 1e-3) / 1e12
            row["variants"].append(entry)
            print(f"{name}: {tile} cap={cap}: {entry['us']:8.1f} us {entry['tbs']:.2f} TB/s regs {entry.get('regs')} "
                  f"spills {entry.get('spills')} equal {entry['bitwise_equal_to_uncapped']}", flush=True)  # fmt: skip
        results.append(row)
        with open(os.path.join(out_dir, "s24_e_kernel.json"), "w") as f:
            json.dump(results, f, indent=1)
        del k, v, tables, qs
        if not DRY:
            torch.cuda.empty_cache()
    return results


def best_cap(results):
    """The cap on today's tile with the best geometric-mean time over the chat shapes, and its gain."""
    tile = attention_config.DECODE_TILES[2][0] if not DRY else VARIANTS[0][0]
    chat = [r for r in results if r["shape"].startswith("chat") or DRY]
    scores = {}
    for r in chat:
        for e in r["variants"]:
            if tuple(e["tile"]) == tuple(tile):
                scores.setdefault(e["maxnreg"], []).append(math.log(e["us"]))
    base = sum(scores[None]) / len(scores[None])
    cap = min((c for c in scores if c is not None), key=lambda c: sum(scores[c]) / len(scores[c]))
    return tile, cap, math.exp(base - sum(scores[cap]) / len(scores[cap]))


def engine_phase(results, out_dir):
    import benchmark

    import hfpaged

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))
    from _probe import probe_model

    tile, cap, gain = best_cap(results)
    print(f"[engine] best cap on {tile}: {cap} ({gain:.3f}x over the chat shapes)", flush=True)
    if gain < 1.02 and not DRY:
        return
    summary = dict(tile=tile, cap=cap, kernel_gain=gain, models={})
    for name in ("qwen3-0.6b", "llama-3.2-1b") if not DRY else ("dry",):
        model = probe_model(name, DRY)
        chat = benchmark.workload("chat", 256 if not DRY else 4, model.config.vocab_size)
        if DRY:
            chat = ([p[:40] for p in chat[0]], [3] * 4)
        rates, tokens = {}, {}
        for rep in range(2):
            for setting in ("base", "cap"):
                s24_a.CAPPED.rule = (False, tuple(tile), cap) if setting == "cap" else None
                t = time.perf_counter()
                hfpaged.patch(model, compile=None if not DRY else False)
                benchmark.run_hfpaged(model, *chat)  # warm-up: graphs, compile
                _, _, _, runs = benchmark.timed_runs(model, *chat, repeats=3)
                hfpaged.reset_prefix_cache(model)
                out = model.generate_many(chat[0], max_new_tokens=chat[1][0], do_sample=False, eos_token_id=None)
                tokens.setdefault(setting, [r.token_ids for r in out])
                rates.setdefault(setting, []).append(sorted(runs)[1])
                hfpaged.unpatch(model)
                s24_a.CAPPED.rule = None
                print(f"[engine] {name} rep {rep} {setting}: chat {sorted(runs)[1]:,.0f} tok/s (runs "
                      + ", ".join(f"{r:,.0f}" for r in runs) + f") ({time.perf_counter() - t:.0f} s)", flush=True)
                if not DRY:
                    torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(tokens["base"], tokens["cap"]))
        print(f"[engine] {name}: greedy outputs with the cap equal to without: {same} of {len(tokens['base'])}", flush=True)
        summary["models"][name] = dict(rates=rates, same_tokens=same, requests=len(tokens["base"]))
        with open(os.path.join(out_dir, "s24_e_engine.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        del model
        if not DRY:
            torch.cuda.empty_cache()


def main():
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    os.makedirs(out_dir, exist_ok=True)
    results = kernel_phase(out_dir)
    print(f"best cap over the chat shapes: {best_cap(results)}", flush=True)
    if "--engine" in sys.argv:
        engine_phase(results, out_dir)


if __name__ == "__main__":
    main()
