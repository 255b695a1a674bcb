"""Probe A (session 24): decode attention with a register cap (Triton's ``maxnreg``) and other decode tiles, kernel
alone, then (where a variant wins) in the engine.

    python notes/results/session24/s24_a.py OUT_DIR [--engine] [--dry-run]

Phase 1 (kernel, CUDA-graph timing as examples/sweep_fp8_decode.py, Qwen3-0.6B heads 16/8 x 128, block 16, one
query per sequence as the engine's decode graphs): e4m3 and bf16 caches at engine-like batch x context shapes,
every (TILE_N, num_warps, num_stages) x maxnreg variant; registers and spills of each compiled variant; outputs
checked against the default config. Phase 2 (--engine): for a dtype whose best variant beats today's tile by >= 4%
(geometric mean over the batch >= 128 shapes, those nano's decode graphs run), the nano-vllm shape in the engine
with today's tile and that variant alternating (fresh patch each, so graphs are captured with it): fp8 with an
8 GiB pool (bench_fp8_kv.py's setting), bf16 with the default pool; greedy tokens compared.
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
sys.path.insert(0, "examples")

import torch  # noqa: E402

import sweep_fp8_decode as sweep  # noqa: E402
from hfpaged.kernels import attention_config  # noqa: E402

pa = sweep.pa_module
KERNEL = pa._paged_attention_kernel if not isinstance(pa._paged_attention_kernel, sweep._KernelWithFlag) else (
    pa._paged_attention_kernel.kernel)  # fmt: skip
FP8 = torch.float8_e4m3fn


class Capped:
    """Stands in for ``_paged_attention_kernel``: decode launches (BLOCK_M 16) of one KV kind and tile get maxnreg;
    records (registers, spills) of what each launch compiled."""

    def __init__(self):
        self.rule = None  # (kv_fp8, (tile_n, warps, stages), maxnreg) or None
        self.last = None

    def __getitem__(self, grid):
        launch = KERNEL[grid]

        def run(*args, **kwargs):
            rule = self.rule
            if rule is not None and kwargs.get("BLOCK_M") == 16 and bool(kwargs.get("KV_FP8")) == rule[0] and (
                (kwargs["TILE_N"], kwargs["num_warps"], kwargs["num_stages"]) == rule[1]) and rule[2]:  # fmt: skip
                kwargs["maxnreg"] = rule[2]
            compiled = launch(*args, **kwargs)
            self.last = compiled
            return compiled

        return run


CAPPED = Capped()
pa._paged_attention_kernel = CAPPED

TILES = {
    "fp8": [(128, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (32, 4, 2), (32, 4, 3)],
    "bf16": [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (32, 4, 2)],
}  # fmt: skip
CAPS = {"fp8": [None, 168, 128], "bf16": [None, 128]}
SHAPES = {
    "fp8": [(256, 512), (256, 1024), (256, 2048), (128, 2048), (64, 4096), (24, 6144)],
    "bf16": [(256, 1024), (256, 2048), (128, 2048)],
}
if DRY:
    TILES = {"fp8": [(32, 4, 2)], "bf16": [(32, 4, 2)]}
    CAPS = {"fp8": [None, 128], "bf16": [None]}
    SHAPES = {"fp8": [(4, 64)], "bf16": [(4, 64)]}


def log(msg):
    print(msg, flush=True)


def kernel_phase(out_dir):
    device = "cpu" if DRY else "cuda"
    results = []
    for kind in ("fp8", "bf16"):
        kv = FP8 if kind == "fp8" else torch.bfloat16
        q_dtype = torch.float16 if DRY else torch.bfloat16
        if DRY and kind == "bf16":
            kv = torch.float16
        for batch, context in SHAPES[kind]:
            problem = sweep.DecodeProblem(batch, context, kv, q_dtype, device)
            default = dataclasses.replace(problem.default_config(), one_query=True)
            base_out = problem.call(default)().clone()
            shape = dict(kind=kind, batch=batch, context=context, default=vars(default), rows=[])
            for tile in TILES[kind]:
                for cap in CAPS[kind]:
                    config = dataclasses.replace(default, tile_n=tile[0], num_warps=tile[1], num_stages=tile[2])
                    CAPPED.rule = (kind == "fp8", tile, cap)
                    row = sweep.measure(problem, config, base_out)
                    row.update(tile=tile, maxnreg=cap)
                    compiled = CAPPED.last
                    if compiled is not None and not DRY:
                        try:
                            compiled._init_handles()
                            row.update(regs=compiled.n_regs, spills=compiled.n_spills)
                        except Exception as exc:  # noqa: BLE001 - reporting only
                            row["regs_error"] = str(exc)[:100]
                    CAPPED.rule = None
                    shape["rows"].append(row)
                    log(f"{kind} B={batch:3d} ctx={context:5d} {tile} cap={cap}: "
                        + (f"skipped {row['skipped']}" if "skipped" in row else
                           f"{row['us']:8.1f} us {row['gbs']:6.0f} GB/s regs {row.get('regs')} spills {row.get('spills')}"))  # fmt: skip
            results.append(shape)
            (out_dir / "s24_a_kernel.json").write_text(json.dumps(results, indent=2, default=str))
            del problem
            if not DRY:
                torch.cuda.empty_cache()
    return results


def best_variant(results, kind):
    """(tile, cap, gain) of the variant with the best geometric-mean time over the kind's batch >= 128 shapes."""
    base_tile = attention_config.DECODE_TILES[1 if kind == "fp8" else 2][0] if not DRY else TILES[kind][0]
    shapes = [s for s in results if s["kind"] == kind and s["batch"] >= (128 if not DRY else 1)]
    scores = {}
    for s in shapes:
        for r in s["rows"]:
            if "us" in r:
                scores.setdefault((tuple(r["tile"]), r["maxnreg"]), []).append(math.log(r["us"]))
    scores = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == len(shapes)}
    base = scores.get((tuple(base_tile), None))
    if base is None or not scores:
        return None
    best = min(scores, key=scores.get)
    return best[0], best[1], math.exp(base - scores[best])


def engine_phase(results, out_dir):
    import benchmark

    import hfpaged

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session20"))
    from _probe import probe_model

    model = probe_model("qwen3-0.6b", DRY)
    nano = benchmark.workload("nano", 256 if not DRY else 4, model.config.vocab_size)
    if DRY:
        nano = ([p[:40] for p in nano[0]], [3] * 4)
    summary = {}
    if DRY:  # exercise the engine phase with the dry run's only variant
        attention_config.DECODE_TILES[1] = attention_config.DECODE_TILES[2] = ((32, 4, 2), (32, 4, 2))
    for kind in ("fp8", "bf16"):
        choice = best_variant(results, kind)
        log(f"[engine] {kind}: best variant {choice}")
        if choice is None or (choice[2] < 1.04 and not DRY):
            continue
        key = 1 if kind == "fp8" else 2
        base_tiles = attention_config.DECODE_TILES[key]
        settings = {"base": (base_tiles, None), "variant": ((choice[0], base_tiles[1]), (kind == "fp8", choice[0], choice[1]))}
        tokens, rates = {}, {}
        for rep in range(2):
            for name, (tiles, rule) in settings.items():
                attention_config.DECODE_TILES[key] = tiles
                CAPPED.rule = rule
                options = dict(kv_cache_dtype="fp8" if kind == "fp8" else "auto")
                if kind == "fp8" and not DRY:
                    block_bytes = 16 * 28 * 8 * 128 * 2
                    options["num_blocks"] = (8 << 30) // block_bytes
                hfpaged.patch(model, compile=None if not DRY else False, **options)
                short = [p[:256] for p in nano[0][:8]]
                model.generate_many(short, max_new_tokens=32, do_sample=False)
                model.generate_many(short * 8, max_new_tokens=16, do_sample=False)
                hfpaged.reset_prefix_cache(model)
                if not DRY:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate_many([{"prompt": p, "max_new_tokens": n} for p, n in zip(*nano)],
                                          do_sample=False, eos_token_id=None)  # fmt: skip
                if not DRY:
                    torch.cuda.synchronize()
                rate = sum(len(r.token_ids) for r in out) / (time.perf_counter() - t)
                stats = hfpaged.stats(model)
                rates.setdefault(name, []).append(rate)
                tokens.setdefault(name, [r.token_ids for r in out])
                log(f"[engine] {kind} rep {rep} {name}: nano {rate:,.0f} tok/s, preemptions {stats['num_preemptions']}")
                hfpaged.unpatch(model)
                attention_config.DECODE_TILES[key] = base_tiles
                CAPPED.rule = None
                if not DRY:
                    torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(tokens["base"], tokens["variant"]))
        log(f"[engine] {kind}: greedy outputs of the variant equal to base: {same} of {len(tokens['base'])}")
        summary[kind] = dict(variant=choice, rates=rates, same_tokens=same, requests=len(tokens["base"]))
        (out_dir / "s24_a_engine.json").write_text(json.dumps(summary, indent=2, default=str))


def main():
    import pathlib

    out_dir = pathlib.Path([a for a in sys.argv[1:] if not a.startswith("--")][0])
    out_dir.mkdir(parents=True, exist_ok=True)
    results = kernel_phase(out_dir)
    for kind in ("fp8", "bf16"):
        log(f"{kind}: best variant over batch >= 128 shapes: {best_variant(results, kind)}")
    if "--engine" in sys.argv:
        engine_phase(results, out_dir)


if __name__ == "__main__":
    main()
