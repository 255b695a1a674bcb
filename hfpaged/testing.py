"""Helpers that measure hfpaged: greedy agreement with stock ``generate`` next to its yardstick, the KV blocks
parallel sampling saves, and a soak of many short requests (memory and pool flat). Used by the test suite and
the scripts in ``examples/``.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

from .engine import Engine
from .patch import patch, stats, unpatch


def greedy_parity(
    model: Any,
    prompts: list[list[int]] | None = None,
    num_prompts: int = 32,
    new_tokens: int = 32,
    compile: bool | None = None,
    stop_at_eos: bool = False,
    **patch_options: Any,
) -> dict[str, Any]:
    """Greedy tokens of generate_many vs stock generate (each prompt alone) in the model's own dtype.

    Compares the first ``new_tokens`` tokens of each prompt's output. Random weights give near-tied logits,
    so low-precision runs part ways after a few tokens whatever computes them. As a yardstick, stock
    generate with eager attention is compared with stock generate with sdpa the same way: two correct
    implementations that differ only in rounding. Without ``prompts``, random ones of 16-256 tokens; with
    ``stop_at_eos`` the model's own eos ends a sequence (real models), otherwise eos is ignored.
    ``patch_options`` go to ``patch`` (e.g. ``fuse_projections=False``).
    """
    if prompts is None:
        gen = torch.Generator().manual_seed(3)
        vocab = model.config.vocab_size
        prompts = [
            torch.randint(10, vocab - 10, (int(n),), generator=gen).tolist()
            for n in torch.randint(16, 257, (num_prompts,), generator=gen)
        ]
    options = dict(max_new_tokens=new_tokens, do_sample=False) | ({} if stop_at_eos else dict(eos_token_id=None))
    # stock generate also keeps any default eos of the model's generation config from ending a sequence early
    stock_options = options | ({} if stop_at_eos else dict(min_new_tokens=new_tokens))
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)

    def stock(implementation):
        model.set_attn_implementation(implementation)
        out = []
        with torch.no_grad():
            for p in prompts:
                seq = model.generate(torch.tensor([p], device=model.device), pad_token_id=pad, **stock_options)
                out.append(seq[0, len(p) :].tolist())
        return out

    def agreement(got, expected):
        prefix = [
            next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
            for g, e in zip(got, expected)
        ]
        return {
            "share_all_match": sum(g == e for g, e in zip(got, expected)) / len(prompts),
            "share_first_match": sum(g[:1] == e[:1] for g, e in zip(got, expected)) / len(prompts),
            "mean_matching_prefix": sum(prefix) / len(prompts),
        }

    original = model.config._attn_implementation
    try:
        eager = stock("eager")
        expected = stock("sdpa")
    finally:
        model.set_attn_implementation(original)
    patch(model, compile=compile, **patch_options)
    try:
        got = [r.token_ids for r in model.generate_many(prompts, **options)]
    finally:
        unpatch(model)
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "dtype": str(next(model.parameters()).dtype),
        **agreement(got, expected),
        "stock_eager_vs_sdpa": agreement(eager, expected),
    }


def parallel_sampling_kv(
    model: Any, prompts: list[list[int]], n: int = 4, new_tokens: int = 128, seed: int = 0, **patch_options: Any
) -> dict[str, Any]:
    """Peak KV blocks in use: each prompt with num_return_sequences=n (the samples share the prompt's blocks)
    vs the same prompt given n times as independent requests. Prefix caching is off for both runs, so the
    independent requests share nothing. Works on any device (tests call it with a tiny model on CPU).
    """
    patch(model, **{**patch_options, "enable_prefix_caching": False})
    settings = dict(max_new_tokens=new_tokens, do_sample=True, top_k=50, eos_token_id=None)

    def run(requests):
        engine = Engine(model)
        kv = engine.core.kv
        for i, (prompt, extra) in enumerate(requests):
            engine.add_request(prompt, seed=seed + i, **settings, **extra)
        peak = num_tokens = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
            peak = max(peak, kv.num_blocks - kv.num_free_blocks)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        assert kv.all_free()
        return {"peak_blocks": peak, "tokens": num_tokens, "seconds": time.perf_counter() - t0}

    state = model._hfpaged
    out = {
        "n": n,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": new_tokens,
        "block_size": state.config.block_size,
        "block_bytes": sum(state.block_bytes().values()),
        "parallel": run([(p, {"num_return_sequences": n}) for p in prompts]),
        "independent": run([(p, {}) for p in prompts for _ in range(n)]),
    }
    out["block_ratio"] = out["parallel"]["peak_blocks"] / out["independent"]["peak_blocks"]
    return out


def _rss_mib() -> float:
    """This process's resident memory now (Linux /proc; ru_maxrss elsewhere, which only grows)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def engine_sizes(model: Any) -> dict[str, int]:
    """How many entries the engine's per-request structures hold (all zero, or bounded, when idle)."""
    core = model._hfpaged.engine
    kv = core.kv
    context = core.runner.sampler.context
    return {
        "unfinished_requests": len(core.scheduler.requests),
        "owners": len(core.owners),
        "kv_tables": len(kv._blocks) + len(kv._cpu_blocks) + len(kv._hashes),
        "runner_states": len(core.runner.batch.states),
        "token_count_slots": len(context.token_counts.slot_of) if context is not None else 0,
    }


def soak(
    model: Any,
    num_requests: int = 100_000,
    wave: int = 2_000,
    prompt_len: tuple[int, int] = (4, 24),
    new_tokens: tuple[int, int] = (1, 8),
    seed: int = 0,
    on_wave: Any = None,
    **settings: Any,
) -> dict[str, Any]:
    """Many short requests through ``generate_many`` in waves; after each wave, host RSS, GPU memory, free
    blocks and the engine's per-request structures (also given to ``on_wave``, as they come). Flat figures
    after the first waves: nothing leaks."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    samples, num_tokens, done = [], 0, 0
    start = time.perf_counter()
    while done < num_requests:
        count = min(wave, num_requests - done)
        entries = [
            {
                "prompt": [rng.randrange(10, vocab - 10) for _ in range(rng.randint(*prompt_len))],
                "max_new_tokens": rng.randint(*new_tokens),
            }
            for _ in range(count)
        ]
        results = model.generate_many(entries, do_sample=False, eos_token_id=None, **settings)
        num_tokens += sum(len(r.token_ids) for r in results)
        done += count
        st = stats(model)
        sample = {
            "requests": done,
            "seconds": time.perf_counter() - start,
            "rss_mib": _rss_mib(),
            "free_blocks": st["num_free_blocks"],
            "num_blocks": st["num_blocks"],
            **engine_sizes(model),
        }
        if torch.cuda.is_available():
            sample["gpu_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
            sample["gpu_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
        samples.append(sample)
        if on_wave is not None:
            on_wave(sample)
    seconds = time.perf_counter() - start
    return {
        "num_requests": done,
        "tokens": num_tokens,
        "seconds": seconds,
        "tokens_per_s": num_tokens / seconds,
        "samples": samples,
    }
