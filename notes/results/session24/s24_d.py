"""Probe D (session 24): e4m3 decode attention with V stored slot-minor ([blocks, kv_heads, head_dim, block_size],
handed to the kernel as a strided view of the usual [blocks, block_size, kv_heads, head_dim]) x tiles x register
caps, kernel alone (session 11 measured the layout at its best tiles: 2-12%; session 24's probe A the caps alone:
4%). Same shapes and timing as probe A (`s24_a.py`); outputs compared with today's layout and tile.

    python notes/results/session24/s24_d.py OUT_DIR [--dry-run]
"""

import dataclasses
import json
import math
import os
import sys

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, "examples")

import torch  # noqa: E402

import s24_a  # noqa: E402  (its kernel wrapper applies the caps)
import sweep_fp8_decode as sweep  # noqa: E402

FP8 = torch.float8_e4m3fn
TILES = [(128, 4, 3), (128, 4, 2), (128, 8, 2), (64, 4, 2), (64, 4, 3), (64, 2, 2), (32, 4, 2), (32, 2, 2), (32, 1, 2)]
CAPS = [None, 168, 128]
SHAPES = [(256, 512), (256, 1024), (256, 2048), (128, 2048), (64, 4096), (24, 6144)]
if DRY:
    TILES, CAPS, SHAPES = [(32, 4, 2)], [None], [(4, 64)]


def slot_minor(cache: torch.Tensor) -> torch.Tensor:
    """The same values, stored [blocks, kv_heads, head_dim, block_size], as a view of the usual logical shape."""
    n, bs, h, d = cache.shape
    phys = torch.empty(n, h, d, bs, dtype=cache.dtype, device=cache.device)
    view = phys.permute(0, 3, 1, 2)
    view.copy_(cache)
    return view


def main():
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--")][0]
    os.makedirs(out_dir, exist_ok=True)
    device = "cpu" if DRY else "cuda"
    q_dtype = torch.float16 if DRY else torch.bfloat16
    results = []
    for batch, context in SHAPES:
        problem = sweep.DecodeProblem(batch, context, FP8, q_dtype, device)
        default = dataclasses.replace(problem.default_config(), one_query=True)
        base_out = problem.call(default)().clone()
        token_major_v = problem.v_cache
        shape = dict(batch=batch, context=context, default=vars(default), rows=[])
        for layout in ("token-major", "slot-minor"):
            problem.v_cache = token_major_v if layout == "token-major" else slot_minor(token_major_v)
            for tile in TILES:
                for cap in CAPS:
                    if layout == "token-major" and tile not in ((128, 4, 3), (64, 4, 2)):
                        continue  # probe A has them
                    config = dataclasses.replace(default, tile_n=tile[0], num_warps=tile[1], num_stages=tile[2])
                    s24_a.CAPPED.rule = (True, tile, cap)
                    row = sweep.measure(problem, config, base_out)
                    row.update(layout=layout, tile=tile, maxnreg=cap)
                    compiled = s24_a.CAPPED.last
                    if compiled is not None and not DRY:
                        try:
                            compiled._init_handles()
                            row.update(regs=compiled.n_regs, spills=compiled.n_spills)
                        except Exception as exc:  # noqa: BLE001 - reporting only
                            row["regs_error"] = str(exc)[:100]
                    s24_a.CAPPED.rule = None
                    shape["rows"].append(row)
                    print(f"B={batch:3d} ctx={context:5d} {layout:11s} {tile} cap={cap}: "
                          + (f"skipped {row['skipped']}" if "skipped" in row else
                             f"{row['us']:8.1f} us {row['gbs']:6.0f} GB/s regs {row.get('regs')} spills "
                             f"{row.get('spills')} diff {row['rel_diff_vs_default']:.1e}"), flush=True)  # fmt: skip
            if not DRY:
                del problem.v_cache
                torch.cuda.empty_cache()
        problem.v_cache = token_major_v
        results.append(shape)
        with open(os.path.join(out_dir, "s24_d.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        del problem
        if not DRY:
            torch.cuda.empty_cache()
    # geometric mean over the batch >= 128 shapes, against today's layout and tile
    scores = {}
    big = [s for s in results if s["batch"] >= (128 if not DRY else 1)]
    for s in big:
        for r in s["rows"]:
            if "us" in r:
                scores.setdefault((r["layout"], tuple(r["tile"]), r["maxnreg"]), []).append(math.log(r["us"]))
    base = scores.get(("token-major", (128, 4, 3), None)) if not DRY else next(iter(scores.values()))
    ranked = sorted((sum(v) / len(v), k) for k, v in scores.items() if len(v) == len(big))
    for mean, key in ranked[:8]:
        print(f"{key}: {math.exp(sum(base) / len(base) - mean):.3f}x today's", flush=True)


if __name__ == "__main__":
    main()
