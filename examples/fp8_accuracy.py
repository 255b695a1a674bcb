"""FP8 KV cache accuracy on a real model: greedy agreement with stock generate, and perplexity of a fixed text.

    python examples/fp8_accuracy.py [--model PATH] [--dtype bfloat16] [--out notes/results/fp8/accuracy.json]

Greedy agreement: 32 chat prompts ("Explain {topic} in two sentences."), first 32 greedy tokens of
``generate_many`` with each ``kv_cache_dtype`` against stock ``generate`` (sdpa, each prompt alone), next to
stock eager-vs-sdpa attention as a yardstick of what rounding alone changes. Perplexity: the Declaration of
Independence (1776, public domain; examples/data/) fed through the paged cache in 64-token chunks, so every
token attends to earlier chunks through the cache (fp8 K/V included) and to its own chunk, which is stored
first and then read back from the cache too. With no --model it takes SmolLM2-135M-Instruct (see
hfpaged.demo_model). Runs on the CPU (torch reference path) or a GPU (Triton).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quickstart import PARITY_TOPICS  # noqa: E402

KV_DTYPES = ("auto", "fp8", "fp8_e5m2")


def matching(got: list[list[int]], expected: list[list[int]]) -> dict:
    prefix = [
        next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e))) for g, e in zip(got, expected)
    ]
    return {
        "share_all_match": sum(g == e for g, e in zip(got, expected)) / len(got),
        "share_first_match": sum(g[:1] == e[:1] for g, e in zip(got, expected)) / len(got),
        "mean_matching_prefix": sum(prefix) / len(got),
    }


def stock_greedy(model, prompts, implementation, new_tokens):
    model.set_attn_implementation(implementation)
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p], device=model.device), max_new_tokens=new_tokens, do_sample=False)
            out.append(seq[0, len(p) :].tolist())
    return out


def paged_perplexity(model, ids: list[int], chunk: int = 64) -> float:
    """Perplexity of ``ids`` computed through the patched model's paged cache, ``chunk`` tokens per forward."""
    from hfpaged.model.attention import AttentionMetadata
    from hfpaged.model.input_batch import DeviceStep

    state = model._hfpaged
    runner = state.engine.runner
    device, block_size = state.input_device, state.config.block_size
    num_blocks = -(-len(ids) // block_size)
    assert num_blocks <= state.num_blocks, "pool too small for the passage"
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids) - 1)
            positions = torch.arange(start, end, device=device)
            meta = AttentionMetadata(
                slot_mapping=positions.int(),  # block b holds slots [b * block_size, (b + 1) * block_size)
                block_tables=table,
                seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
                cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=device),
                max_seqlen_q=end - start,
                max_seqlen_k=end,
            )
            step = DeviceStep(
                torch.tensor([ids[start:end]], device=device),
                positions[None],
                meta,
                torch.arange(end - start, device=device),
            )
            logits = runner.forward(step, calibrate=state.calibration_pending)  # the first chunk calibrates fp8
            state.calibration_pending = False
            targets = torch.tensor(ids[start + 1 : end + 1], device=device)
            nll += float(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
            count += end - start
    return math.exp(nll / count)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local model directory (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfpaged
    from hfpaged.demo_model import fetch_smollm2

    path = args.model or fetch_smollm2()
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    chats = [[{"role": "user", "content": f"Explain {topic} in two sentences."}] for topic in PARITY_TOPICS]
    prompts = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]
    text = (HERE / "data" / "declaration_of_independence.txt").read_text()
    passage = tokenizer(text)["input_ids"]
    report = {"model": path, "dtype": args.dtype, "device": str(args.device), "prompts": len(prompts)}
    report["passage_tokens"] = len(passage)

    t0 = time.perf_counter()
    original = model.config._attn_implementation
    expected = stock_greedy(model, prompts, "sdpa", args.new_tokens)
    eager = stock_greedy(model, prompts, "eager", args.new_tokens)
    model.set_attn_implementation(original)
    report["yardstick_stock_eager_vs_sdpa"] = matching(eager, expected)
    print(f"stock generate done ({time.perf_counter() - t0:.0f} s)", flush=True)

    for kv in KV_DTYPES:
        hfpaged.patch(model, num_blocks=256, kv_cache_dtype=kv)
        got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=args.new_tokens, do_sample=False)]
        entry = matching(got, expected)
        hfpaged.unpatch(model)
        hfpaged.patch(model, num_blocks=256, kv_cache_dtype=kv)
        entry["perplexity"] = paged_perplexity(model, passage)  # a fresh patch: calibrated on the passage
        entry["kv_cache_bytes_per_token"] = hfpaged.stats(model)["kv_cache_bytes_per_token"]
        report[kv] = entry
        hfpaged.unpatch(model)
        print(kv, json.dumps(entry), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    base = report["auto"]["perplexity"]
    for kv in KV_DTYPES[1:]:
        report[kv]["perplexity_increase"] = report[kv]["perplexity"] / base - 1
    y = report["yardstick_stock_eager_vs_sdpa"]
    print(
        f"\n{args.dtype} on {args.device}, {len(prompts)} chat prompts, first {args.new_tokens} greedy tokens vs stock"
    )
    print(f"{'':22} {'all match':>9} {'first':>6} {'mean prefix':>11} {'perplexity':>10} {'bytes/token':>11}")
    print(f"{'stock eager vs sdpa':22} {y['share_all_match']:9.0%} {y['share_first_match']:6.0%} "
          f"{y['mean_matching_prefix']:11.1f}")  # fmt: skip
    for kv in KV_DTYPES:
        e = report[kv]
        print(f"{'hfpaged kv=' + kv:22} {e['share_all_match']:9.0%} {e['share_first_match']:6.0%} "
              f"{e['mean_matching_prefix']:11.1f} {e['perplexity']:10.4f} {e['kv_cache_bytes_per_token']:11d}")  # fmt: skip
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
