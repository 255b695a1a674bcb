"""Data-parallel replicas: one patched model per GPU, a prompt list split across them, results in input order.

Launched with torchrun (no home-made process pool): every rank loads the model on its own GPU, patches it,
runs ``generate_many`` on its share of the prompts (rank r takes prompts r, r + N, r + 2N, ...), and rank 0
gathers the results back into input order.

    torchrun --nproc-per-node 2 examples/data_parallel.py --random-shape qwen3-0.6b --out dp_out
    torchrun --nproc-per-node 1 examples/data_parallel.py --random-shape qwen3-0.6b --out dp_out
    python examples/data_parallel.py --compare dp_out/dp1.json dp_out/dp2.json      # target: >= 1.8x
    torchrun --nproc-per-node 2 examples/data_parallel.py --model PATH              # a checkpoint of yours

On machines without GPUs, ``--device cpu`` runs the same thing over gloo (the tests do, with ``--random-shape
tiny --workload churn``). The default workload is the benchmark's nano shape (prompts and outputs of 100-1,024
tokens, eos ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import MODELS, workload

TINY = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
)


def load(args, device: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype).to(device).eval()
    spec = dict(TINY if args.random_shape == "tiny" else MODELS[args.random_shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)  # the same random weights on every rank
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=args.dtype).eval()


def split(items: list, rank: int, world: int) -> list:
    """Rank ``rank``'s share: items rank, rank + world, ... (interleaved, so shares have similar lengths)."""
    return items[rank::world]


def merge(shares: list[list], total: int) -> list:
    """The inverse of ``split`` over every rank's share: the items back in input order."""
    world = len(shares)
    merged = [None] * total
    for rank, share in enumerate(shares):
        merged[rank::world] = share
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: random weights in --random-shape)")
    parser.add_argument("--random-shape", default="qwen3-0.6b", choices=sorted(MODELS) + ["tiny"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--workload", default="nano", choices=["nano", "chat", "churn"], help="see benchmark.py")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="one length for all (default: 100-1,024)")
    parser.add_argument("--out", default="dp_out")
    parser.add_argument("--compare", nargs=2, metavar=("DP1_JSON", "DPN_JSON"))
    args = parser.parse_args()
    if args.compare:
        with open(args.compare[0]) as f:
            one = json.load(f)
        with open(args.compare[1]) as f:
            many = json.load(f)
        speedup = many["tokens_per_s"] / one["tokens_per_s"]
        print(
            f"{many['world_size']} GPUs: {many['tokens_per_s']:,.0f} tok/s vs 1 GPU {one['tokens_per_s']:,.0f} tok/s "
            f"= {speedup:.2f}x (target >= 1.8x)"
        )
        return
    import hfpaged

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    args.dtype = (
        getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    model = load(args, device)
    prompts, out_lens = workload(args.workload, args.requests, model.config.vocab_size)
    if args.max_new_tokens:
        out_lens = [args.max_new_tokens] * len(prompts)
    mine, my_lens = split(prompts, rank, world), split(out_lens, rank, world)

    hfpaged.patch(model)
    model.generate_many(mine[:16], max_new_tokens=8, do_sample=False, eos_token_id=None)  # warm-up
    hfpaged.reset_prefix_cache(model)  # the timed run prefills every prompt (no prefix hits from the warm-up)
    dist.barrier()
    t0 = time.perf_counter()
    requests = [{"prompt": p, "max_new_tokens": n} for p, n in zip(mine, my_lens)]
    results = model.generate_many(requests, do_sample=False, eos_token_id=None)
    mine_done = time.perf_counter() - t0
    dist.barrier()  # the job ends when the slowest replica does
    seconds = time.perf_counter() - t0
    shares = [None] * world
    dist.all_gather_object(shares, [list(r.token_ids) for r in results])
    token_ids = merge(shares, len(prompts))
    if rank == 0:
        tokens = sum(len(t) for t in token_ids)
        report = {
            "world_size": world,
            "device": str(device),
            "requests": len(prompts),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "rank0_seconds": mine_done,
            "token_ids": token_ids,
        }
        print(f"{world} replica(s): {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"dp{world}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
