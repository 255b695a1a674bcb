"""A GRPO-style loop with hfpaged as the rollout engine: the policy being trained is the model generating.

Each step samples ``--n`` completions per prompt from the current policy (a LoRA adapter on the model),
scores them with a programmatic reward (how close the answer's length is to ``--target-words`` words),
turns the rewards into group-relative advantages (reward minus its group's mean, over the group's
standard deviation), and takes one optimizer step on ``-advantage x mean log-probability`` of each
completion. No weight sync: the next rollouts use the updated adapter at once (hfpaged notices the changed
parameters itself); on CUDA the KV pool is released for the training step (``hfpaged.sleep``) and comes back
with the next rollout.

    python examples/rl_rollouts.py                         # SmolLM2-135M-Instruct + LoRA r=16, hfpaged
    python examples/rl_rollouts.py --backend stock         # the same loop, rollouts by stock generate
    python examples/rl_rollouts.py --random-shape llama-3.2-1b --rollouts-only \\
        --prompts 64 --n 8 --new-tokens 256 --backends hfpaged stock generate_batch   # rollout throughput

It prints the mean reward of every step (it should rise) and rollout tokens/s; ``--out`` gets a JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import hfpaged
from hfpaged.demo_model import fetch_smollm2

TOPICS = [
    "the sea",
    "a city at night",
    "coffee",
    "the moon",
    "a library",
    "autumn",
    "a train",
    "music",
    "the desert",
    "a garden",
    "snow",
    "a market",
    "the stars",
    "bread",
    "a river",
    "the mountains",
]


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, object]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.random_shape:
        from benchmark import build_model

        model, tokenizer = build_model(args.random_shape, dtype), None
    else:
        path = args.model or fetch_smollm2()
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(model, config), tokenizer


def make_prompts(tokenizer, num_prompts: int, vocab_size: int) -> list[list[int]]:
    if tokenizer is None:  # random weights: random prompts of 64-256 tokens
        gen = torch.Generator().manual_seed(0)
        return [
            torch.randint(
                10, vocab_size - 10, (int(torch.randint(64, 257, (1,), generator=gen)),), generator=gen
            ).tolist()
            for _ in range(num_prompts)
        ]
    chats = [
        [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(num_prompts)
    ]
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]


def rollouts(model, backend: str, prompts: list[list[int]], n: int, new_tokens: int, seed: int, eos: bool):
    """``n`` sampled completions per prompt (prompt-major order) and the seconds they took."""
    settings = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new_tokens)
    if not eos:
        settings["eos_token_id"] = None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if backend == "hfpaged":
        results = model.generate_many(prompts, num_return_sequences=n, seed=seed, **settings)
        completions = [s.token_ids for r in results for s in r.sequences]
    elif backend == "generate_batch":
        config = GenerationConfig(
            pad_token_id=0,
            **{k: v for k, v in settings.items() if k != "eos_token_id"},
            **({} if eos else {"eos_token_id": -1}),
        )
        outputs = model.generate_batch(
            inputs=[p for p in prompts for _ in range(n)], generation_config=config, progress_bar=False
        )
        completions = [outputs[k].generated_tokens for k in sorted(outputs, key=lambda k: int(k.split("_")[-1]))]
    else:  # stock generate, one prompt at a time with its n samples as a batch
        torch.manual_seed(seed)
        completions = []
        for p in prompts:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([p], device=model.device), num_return_sequences=n, pad_token_id=0, **settings
                )
            eos_ids = set() if not eos else set(_as_list(model.generation_config.eos_token_id))
            for row in out[:, len(p) :].tolist():
                end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
                completions.append(row[:end])
    sync()
    return completions, time.perf_counter() - t0


def _as_list(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def rewards_of(tokenizer, completions: list[list[int]], target_words: int) -> list[float]:
    """1 at exactly ``target_words`` words, falling linearly to 0 at twice as many (or none)."""
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    return [max(0.0, 1.0 - abs(len(t.split()) - target_words) / target_words) for t in texts]


def train_step(model, optimizer, prompts, completions, rewards, n: int) -> float:
    """One GRPO-style step: group-relative advantages weight each completion's mean log-probability."""
    advantages = []
    for g in range(len(prompts)):
        group = rewards[g * n : (g + 1) * n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / n) + 1e-4
        advantages += [(r - mean) / std for r in group]
    model.train()
    device = next(model.parameters()).device
    total = 0.0
    for g, prompt in enumerate(prompts):  # one prompt's group per forward: bounded memory
        rows = [prompt + completions[g * n + j] for j in range(n)]
        width = max(map(len, rows))
        ids = torch.zeros(n, width, dtype=torch.long, device=device)
        mask = torch.zeros(n, width, dtype=torch.long, device=device)
        for j, row in enumerate(rows):
            ids[j, : len(row)] = torch.tensor(row)
            mask[j, : len(row)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        completion = torch.zeros_like(logprobs)
        for j, row in enumerate(rows):
            completion[j, len(prompt) - 1 : len(row) - 1] = 1
        per_sequence = (logprobs * completion).sum(-1) / completion.sum(-1).clamp(min=1)
        adv = torch.tensor(advantages[g * n : (g + 1) * n], device=device)
        loss = -(adv * per_sequence).mean() / len(prompts)
        loss.backward()
        total += float(loss.detach())
    optimizer.step()
    optimizer.zero_grad()
    model.eval()
    return total


def gpu_mib() -> float:
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--random-shape", help="random weights in a benchmark.py shape, e.g. llama-3.2-1b")
    parser.add_argument("--backend", default="hfpaged", choices=["hfpaged", "stock", "generate_batch"])
    parser.add_argument("--backends", nargs="+", help="with --rollouts-only: measure each of these")
    parser.add_argument("--rollouts-only", action="store_true", help="time rollouts, no training")
    parser.add_argument("--stock-prompts", type=int, default=0, help="stock generate on this many prompts only")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--target-words", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load(args)
    model.eval()
    prompts = make_prompts(tokenizer, args.prompts, model.config.vocab_size)
    report: dict = {"args": vars(args), "device": str(next(model.parameters()).device)}
    memory = {"before_patch_mib": gpu_mib()}
    hfpaged.patch(model, tokenizer=tokenizer, max_num_seqs=max(256, args.prompts * args.n))
    memory["patched_mib"] = gpu_mib()
    if args.rollouts_only:
        report["rollouts"] = {}
        for backend in args.backends or [args.backend]:
            rollouts(model, backend, prompts[:2], 2, 8, seed=1, eos=tokenizer is not None)  # warm-up
            hfpaged.reset_prefix_cache(model)  # the timed rollouts prefill every prompt (none cached by the warm-up)
            subset = prompts[: args.stock_prompts] if backend == "stock" and args.stock_prompts else prompts
            completions, seconds = rollouts(
                model, backend, subset, args.n, args.new_tokens, seed=2, eos=tokenizer is not None
            )
            if backend == "hfpaged":
                memory["awake_mib"] = gpu_mib()
                hfpaged.sleep(model)
                memory["asleep_mib"] = gpu_mib()
                hfpaged.wake(model)
                memory["woken_mib"] = gpu_mib()
            tokens = sum(map(len, completions))
            report["rollouts"][backend] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
            print(f"{backend:>15}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s", flush=True)
        base = report["rollouts"].get("hfpaged", {}).get("tokens_per_s")
        for backend, figures in report["rollouts"].items():
            if base and backend != "hfpaged":
                print(f"hfpaged vs {backend}: {base / figures['tokens_per_s']:.1f}x")
    else:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        report["steps"] = []
        for step in range(args.steps):
            completions, seconds = rollouts(model, args.backend, prompts, args.n, args.new_tokens, seed=step, eos=True)
            if step == 0:
                memory["awake_mib"] = gpu_mib()
            rewards = rewards_of(tokenizer, completions, args.target_words)
            if args.backend == "hfpaged" and torch.cuda.is_available():
                hfpaged.sleep(model)  # the training step gets the pool's memory
                memory.setdefault("asleep_mib", gpu_mib())
            loss = train_step(model, optimizer, prompts, completions, rewards, args.n)
            tokens = sum(map(len, completions))
            mean = sum(rewards) / len(rewards)
            report["steps"].append(
                {"step": step, "mean_reward": mean, "loss": loss, "rollout_tokens": tokens, "rollout_seconds": seconds}
            )
            print(
                f"step {step:3d}: mean reward {mean:.3f}, rollout {tokens} tokens in {seconds:.2f} s "
                f"({tokens / seconds:,.0f} tok/s), loss {loss:+.4f}",
                flush=True,
            )
        sample = tokenizer.decode(completions[0], skip_special_tokens=True)
        print(f"a completion after training: {sample!r}")
    if torch.cuda.is_available():
        report["gpu_memory"] = memory
        print("GPU memory (MiB): " + ", ".join(f"{k} {v:,.0f}" for k, v in memory.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rl_rollouts.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
