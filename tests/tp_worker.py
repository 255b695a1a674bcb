"""One rank of the tensor-parallel tests (run by tests/test_tensor_parallel.py under torchrun).

Loads the checkpoint twice: unsharded (the TP=1 reference: stock ``generate``) and with ``tp_plan="auto"``
(sharded over the ranks), patches the sharded one with a pool small enough to preempt (recompute, then swap
after the weights change in place), and writes what it saw to ``<out>/rank<r>.json`` for the test to check.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import hfpaged
from hfpaged.model.tp_local import local_kind

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import random_prompts, reference_generate


class Ban(LogitsProcessor):
    """Bans one token (a user processor: the ranks compare its fields)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


def ids_of(results) -> list[list[int]]:
    return [list(result.token_ids) for result in results]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--fuse", choices=("on", "off"), default="off", help="fuse_projections for the patch")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(150, exit=True)  # a hang shows where each rank waits
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sharded = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=torch.float32).eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    prompts = random_prompts([5, 17, 9, 30, 3, 12], seed=1)
    expected = reference_generate(reference, prompts, max_new_tokens=args.new_tokens, do_sample=False)
    result: dict = {"rank": rank, "world_size": world, "expected": expected}

    # pools that differ per rank: every rank must end up with the smallest one
    # (CUDA: a block count per rank; the CPU: a memory budget per rank, the path that sizes the pool)
    pool = {"num_blocks": 12 * (1 + rank)} if device.type == "cuda" else {"cpu_kv_cache_gib": (1 + rank) * 1.2e-5}
    pool["fuse_projections"] = args.fuse == "on"
    hfpaged.patch(sharded, block_size=4, max_num_seqs=4, **pool)
    state = sharded._hfpaged
    result["local_projections"] = len(state.local_tp.members) if state.local_tp is not None else 0
    result["fused_groups"] = len(state.fused_projections.groups)
    result["all_reduce"] = state.local_tp.reduce.kind if state.local_tp is not None else None
    if device.type == "cuda":  # every path of the all-reduce against the process group's own sum
        reduce, checks = state.local_tp.reduce, {}
        gen = torch.Generator(device).manual_seed(rank)
        for numel in (2048, 1 << 18, 1 << 22):  # float32: 8 KiB one-shot, 1 MiB two-shot, 16 MiB NCCL
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(numel, device=device, generator=gen) * (rank + 1)).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=reduce.group)
                checks[f"{numel}/{dtype}"] = [reduce.path(x), torch.equal(reduce(x), want)]
        result["all_reduce_paths"] = checks
    # the gathered lm head and the vocab-sharded embedding keep transformers' forwards
    result["kept_stock"] = [local_kind(sharded.lm_head), local_kind(sharded.get_input_embeddings())]
    stats = hfpaged.stats(sharded)
    result["num_blocks"] = stats["num_blocks"]
    result["greedy"] = ids_of(sharded.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=False))
    runner = sharded._hfpaged.engine.runner
    captured = [g for g in (runner.graphs, runner.mixed_graphs) if g is not None]
    result["graph_kinds"] = len(captured)
    result["capture_retries"] = sum(g.capture_retries for g in captured)
    result["preemptions"] = hfpaged.stats(sharded).get("num_preemptions")
    result["sampled"] = ids_of(sharded.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=True, top_k=0))
    result["kv_heads_local"] = sharded._hfpaged.layers[0].num_kv_heads

    # a rank that submits other prompts: every rank gets the error, and the model stays usable
    mismatched = [p + [rank + 3] for p in prompts[:2]]
    try:
        sharded.generate_many(mismatched, max_new_tokens=4)
        result["mismatch_error"] = None
    except ValueError as error:
        result["mismatch_error"] = str(error)
    # the same prompts with settings that differ by rank (a processor's token list, a temperature): refused too
    result["settings_errors"] = []
    for settings in ({"suppress_tokens": [5 + rank]}, {"do_sample": True, "temperature": 0.5 + rank, "seed": 3}):
        try:
            sharded.generate_many(prompts[:2], max_new_tokens=4, **settings)
            result["settings_errors"].append(None)
        except ValueError as error:
            result["settings_errors"].append(str(error))
    try:
        sharded.generate_many(prompts[:1], max_new_tokens=4, max_time=10.0)
        result["max_time_error"] = None
    except ValueError as error:
        result["max_time_error"] = str(error)
    # refused on some ranks only (rank 1: a token outside the vocabulary; one more unseeded sampled prompt), or
    # with a user processor whose values differ by rank: every rank raises, and the ranks stay in step (their
    # seed generators too: unseeded sampling afterwards draws the same on every rank)
    result["one_rank_errors"] = []
    calls = (
        dict(prompts=[prompts[0] + ([10**6] if rank == 1 else [])], max_new_tokens=4),
        dict(prompts=prompts[: 2 + rank], max_new_tokens=4, do_sample=True),
        dict(prompts=prompts[:2], max_new_tokens=4, logits_processor=LogitsProcessorList([Ban(5 + rank)])),
    )
    for call in calls:
        try:
            sharded.generate_many(**call)
            result["one_rank_errors"].append(None)
        except ValueError as error:
            result["one_rank_errors"].append(str(error))
    # an empty call on one rank only: before, rank 1 returned at once and rank 0's call paired with its next one
    try:
        sharded.generate_many(prompts[:1] if rank == 0 else [], max_new_tokens=4)
        result["one_rank_errors"].append(None)
    except ValueError as error:
        result["one_rank_errors"].append(str(error))
    # patch options that differ by rank (they shape every step): refused on every rank, the working patch kept
    try:
        hfpaged.patch(sharded, block_size=4, max_num_seqs=4 + rank, **pool)
        result["options_error"] = None
    except ValueError as error:
        result["options_error"] = str(error)
    result["sampled_after_refusals"] = ids_of(sharded.generate_many(prompts, max_new_tokens=4, do_sample=True))
    result["greedy_after_errors"] = ids_of(
        sharded.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=False)
    )
    stats = hfpaged.stats(sharded)
    result["free_after"] = [stats["num_free_blocks"], stats["num_blocks"]]

    # the engine's streaming handle runs in lockstep too
    engine = hfpaged.Engine(sharded)
    ids = [engine.add_request(p, max_new_tokens=args.new_tokens, do_sample=False) for p in prompts[:3]]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    result["engine"] = [tokens[i] for i in ids]

    # weights changed in place on every rank (as an optimizer step would): the prompts' cached prefix blocks
    # hold old-weight K/V and must not be reused; then the same with swap preemption instead of recompute
    with torch.no_grad():
        for (name, param), ref_param in zip(sharded.named_parameters(), reference.parameters()):
            if name.endswith("mlp.down_proj.weight"):  # rowwise: a local shard
                param.mul_(-1.0)
                ref_param.mul_(-1.0)
            if name.endswith("mlp.up_proj.weight"):  # colwise: with --fuse on, a slice of the fused buffer
                param.mul_(0.5)
                ref_param.mul_(0.5)
    result["expected_changed"] = reference_generate(reference, prompts, max_new_tokens=args.new_tokens, do_sample=False)
    result["greedy_changed"] = ids_of(sharded.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=False))
    hfpaged.patch(sharded, block_size=4, max_num_seqs=4, preemption_mode="swap", **pool)
    result["greedy_swap"] = ids_of(sharded.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=False))
    stats = hfpaged.stats(sharded)
    result["swapped_out"] = stats.get("num_swapped_out", 0)
    result["free_after_swap"] = [stats["num_free_blocks"], stats["num_blocks"]]
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # On two H200s, destroy_process_group() hung after a run whose CUDA graphs replayed NCCL calls (the graphs
    # were still alive): end the process without tearing the communicators down (every result is written).
    hfpaged.unpatch(sharded)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
