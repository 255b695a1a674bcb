"""Batch-1 decode with fused q/k/v and gate/up projections (patch(..., fuse_projections=True)) vs unfused,
and GPU memory before/after patch with the KV pool excluded.

One process, one model (random weights in a real shape, bf16, built from config as benchmark.py does); the
two settings alternate over --rounds rounds (each a fresh patch: graphs captured, compiled with --compile),
each round timing --repeats batch-1 runs; medians are reported. Writes JSON.

    python examples/bench_fused_projections.py --model llama-3.2-1b --compile --out bench_out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import MODELS, batch1_latency, build_model, weight_bytes_per_token

import hfpaged


def storage_bytes(model) -> int:
    """Bytes of the distinct storages the parameters live in."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def patched_memory(model, fuse: bool, compile: bool, num_blocks: int) -> dict:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    storages_before = storage_bytes(model)
    hfpaged.patch(model, num_blocks=num_blocks, max_num_seqs=8, compile=compile, fuse_projections=fuse)
    torch.cuda.synchronize()
    state = model._hfpaged
    pool = sum(k.nbytes + v.nbytes for k, v in state.kv_caches)
    after = torch.cuda.memory_allocated() - pool
    return {
        "fused_groups": len(state.fused_projections.groups),
        "allocated_before_mib": before / 2**20,
        "allocated_after_without_pool_mib": after / 2**20,
        "change_pct": 100 * (after - before) / before,
        "reserved_after_mib": torch.cuda.memory_reserved() / 2**20,
        "parameter_storage_change_bytes": storage_bytes(model) - storages_before,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=list(MODELS))
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="patch(compile=...): default None (compiled layers on CUDA); --no-compile: eager layers",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations of unfused / fused")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 runs per round")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fused_projections.py needs a CUDA GPU")

    model = build_model(args.model, torch.bfloat16)
    roofline_ms = weight_bytes_per_token(model) / 3.0e12 * 1e3  # at the measured 3.0 TB/s copy bandwidth
    runs = {False: [], True: []}
    memory = {}
    for _ in range(args.rounds):
        for fuse in (False, True):
            memory[fuse] = patched_memory(model, fuse, args.compile, args.num_blocks)
            batch1_latency(model, new_tokens=16)  # warm-up: capture (and compile) outside the timing
            runs[fuse] += [batch1_latency(model, new_tokens=args.new_tokens) for _ in range(args.repeats)]
            hfpaged.unpatch(model)
    result = {
        "model": args.model,
        "compile": args.compile,
        "device": torch.cuda.get_device_name(),
        "roofline_ms": roofline_ms,
        "unfused_ms": statistics.median(runs[False]),
        "fused_ms": statistics.median(runs[True]),
        "runs_ms": {"unfused": runs[False], "fused": runs[True]},
        "memory": {"unfused": memory[False], "fused": memory[True]},
    }
    gain = result["unfused_ms"] - result["fused_ms"]
    print(f"{args.model} batch-1 decode, compile={args.compile}, roofline {roofline_ms:.3f} ms/token")
    for name, fuse in (("unfused", False), ("fused", True)):
        ms = result[f"{name}_ms"]
        mem = memory[fuse]
        print(
            f"  {name:8s} {ms:.3f} ms/token ({roofline_ms / ms:.0%} of roofline)  groups {mem['fused_groups']:3d}  "
            f"allocated {mem['allocated_before_mib']:.1f} -> {mem['allocated_after_without_pool_mib']:.1f} MiB "
            f"without the pool ({mem['change_pct']:+.2f}%)"
        )
    print(f"  fused saves {gain:.3f} ms/token ({gain / result['unfused_ms']:.1%})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(
        args.out,
        f"fused_projections_{args.model}{ {None: '', True: '_compiled', False: '_nocompile'}[args.compile] }.json",
    )
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
