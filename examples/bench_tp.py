"""Tensor parallel vs one GPU: chat-shape throughput and batch-1 latency, hfpaged next to generate_batch.

Run once per tensor-parallel size, under torchrun (random weights in a real shape, bf16; rank 0 saves them
once to ``~/.cache/hfpaged/tp/``, every rank loads them: ``tp_plan="auto"`` when N > 1, one GPU when N = 1):

    torchrun --nproc-per-node 1 examples/bench_tp.py --random-shape llama-3.1-8b --out tp_out
    torchrun --nproc-per-node 2 examples/bench_tp.py --random-shape llama-3.1-8b --out tp_out
    python examples/bench_tp.py --compare tp_out/tp1.json tp_out/tp2.json

Each run writes ``tp<N>.json`` (``tp<N>_compile.json`` / ``tp<N>_nocompile.json`` with ``--compile`` / ``--no-compile``; rank 0): hfpaged tok/s on the chat workload (256 requests, prompts of 32-512
tokens, 128 new each), the same requests through transformers' ``generate_batch`` on the same (sharded) model,
and batch-1 decode ms/token. ``--compare`` prints TP=N against TP=1: the targets are batch-1 <= 0.6x of TP=1's
ms/token and throughput >= 1.6x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import (
    MODELS,
    batch1_latency,
    build_model,
    hfpaged_record,
    run_generate_batch,
    run_hfpaged,
    workload,
)


def log(rank: int, *args) -> None:
    if rank == 0:
        print(*args, flush=True)


def checkpoint(name: str, rank: int) -> str:
    path = os.path.join(os.path.expanduser("~/.cache/hfpaged/tp"), f"{name}-bfloat16")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        t0 = time.perf_counter()
        model = build_model(name, torch.bfloat16)
        model.save_pretrained(path)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        log(rank, f"saved random {name} weights to {path} in {time.perf_counter() - t0:.0f} s")
    dist.barrier()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-shape", default="llama-3.1-8b", choices=sorted(MODELS))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--gb-requests", type=int, default=256, help="requests given to generate_batch (0: skip)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="patch(compile=...): default None (compiled layers on CUDA); --no-compile: eager layers",
    )
    parser.add_argument("--out", default="tp_out")
    parser.add_argument("--compare", nargs=2, metavar=("TP1_JSON", "TPN_JSON"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tp.py needs a CUDA GPU")
    if args.compare:
        compare(*args.compare)
        return
    from transformers import AutoModelForCausalLM

    import hfpaged

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    path = checkpoint(args.random_shape, rank)
    t0 = time.perf_counter()
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    log(rank, f"loaded {args.random_shape} on {world} GPU(s) in {time.perf_counter() - t0:.0f} s")
    prompts, out_lens = workload("chat", args.requests, model.config.vocab_size)
    result = {"shape": args.random_shape, "tensor_parallel_size": world, "requests": len(prompts)}

    if args.gb_requests:  # the peer, on the same (sharded) model, before hfpaged patches it
        n = min(args.gb_requests, len(prompts))
        try:
            run_generate_batch(model, prompts[:4], 4)
            tokens, dt = run_generate_batch(model, prompts[:n], out_lens[0])
            result["generate_batch"] = {"requests": n, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}
            log(rank, f"generate_batch: {tokens / dt:,.0f} tok/s ({n} requests)")
        except Exception:
            result["generate_batch_error"] = traceback.format_exc()
            log(rank, result["generate_batch_error"])
        gc.collect()
        torch.cuda.empty_cache()

    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()  # this rank's weights (local shards) and buffers
    hfpaged.patch(model, max_num_seqs=args.max_num_seqs, compile=args.compile)
    torch.cuda.synchronize()
    stats = hfpaged.stats(model)
    result["num_blocks"] = stats["num_blocks"]
    pool_bytes = stats["num_blocks"] * stats["block_size"] * stats["kv_cache_bytes_per_token"]
    # fused projections re-point the local shards into one buffer per group: no second copy of the weights
    result["memory"] = {
        "allocated_before_patch": allocated_before,
        "allocated_after_patch_without_pool": torch.cuda.memory_allocated() - pool_bytes,
        "pool_bytes": pool_bytes,
    }
    result["memory"]["change_without_pool"] = (
        result["memory"]["allocated_after_patch_without_pool"] / allocated_before - 1
    )
    log(rank, f"allocated after patch without the pool: {result['memory']['change_without_pool']:+.2%} of before")
    result["compile"] = args.compile
    state = model._hfpaged
    result["fused_projection_groups"] = len(state.fused_projections.groups)
    if state.local_tp is not None:
        result["local_projections"] = len(state.local_tp.members)
        result["all_reduce"] = state.local_tp.reduce.kind
    start = time.perf_counter()
    run_hfpaged(model, prompts[:32], [8] * 32)  # warm-up: graph capture, Triton compile
    hfpaged.reset_prefix_cache(model)  # the timed run prefills every prompt (no prefix hits from the warm-up)
    runner = model._hfpaged.engine.runner
    result["first_run_s"] = time.perf_counter() - start
    result["capture_seconds"] = dict(runner.capture_seconds)
    result["capture_retries"] = sum(g.capture_retries for g in (runner.graphs, runner.mixed_graphs) if g is not None)
    # KV slot usage from an untimed run: its per-step sums over the running requests are host work
    usage = run_hfpaged(model, prompts, out_lens, track_usage=True)[2]
    hfpaged.reset_prefix_cache(model)
    tokens, dt, _, engine = run_hfpaged(model, prompts, out_lens)
    result["hfpaged"] = hfpaged_record(model, tokens, dt, usage, engine)  # host seconds per phase included
    log(
        rank,
        f"hfpaged: {tokens / dt:,.0f} tok/s, graph/eager steps {engine.runner.num_graph_steps}/{engine.runner.num_eager_steps}"
        f"; first run {result['first_run_s']:.1f} s, capture retries {result['capture_retries']}",
    )
    if "generate_batch" in result:
        result["speedup_vs_generate_batch"] = (
            result["hfpaged"]["tokens_per_s"] / result["generate_batch"]["tokens_per_s"]
        )
    result["batch1_ms_per_token"] = batch1_latency(model)
    log(rank, f"batch-1 decode: {result['batch1_ms_per_token']:.3f} ms/token")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(
            os.path.join(
                args.out, f"tp{world}{ {None: '', True: '_compile', False: '_nocompile'}[args.compile] }.json"
            ),
            "w",
        ) as f:
            json.dump(result, f, indent=1)
    # On two H200s, destroy_process_group() hung after a run whose CUDA graphs replayed NCCL calls (the graphs
    # were still alive): end the process without tearing the communicators down (every result is written).
    hfpaged.unpatch(model)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def compare(base_path: str, other_path: str) -> None:
    with open(base_path) as f:
        base = json.load(f)
    with open(other_path) as f:
        other = json.load(f)
    n = other["tensor_parallel_size"]
    throughput = other["hfpaged"]["tokens_per_s"] / base["hfpaged"]["tokens_per_s"]
    latency = other["batch1_ms_per_token"] / base["batch1_ms_per_token"]
    print(f"{other['shape']}: TP={n} vs TP=1")
    print(
        f"  chat throughput: {other['hfpaged']['tokens_per_s']:,.0f} vs {base['hfpaged']['tokens_per_s']:,.0f} tok/s = {throughput:.2f}x (target >= 1.6x)"
    )
    print(
        f"  batch-1 decode:  {other['batch1_ms_per_token']:.3f} vs {base['batch1_ms_per_token']:.3f} ms/token = {latency:.2f}x (target <= 0.6x)"
    )
    for run in (base, other):
        if "generate_batch" in run:
            print(
                f"  TP={run['tensor_parallel_size']}: hfpaged {run['speedup_vs_generate_batch']:.1f}x generate_batch "
                f"({run['generate_batch']['tokens_per_s']:,.0f} tok/s)"
            )


if __name__ == "__main__":
    main()
