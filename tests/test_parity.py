"""Greedy generate_many equals stock generate, token for token (float32, CPU), for every architecture.

Each case mixes prompt lengths 1..64, an eos that stops some prompts mid-way, more prompts than
max_num_seqs, a pool too small for all requests at once (preemption must happen) and a token budget
smaller than the longest prompt (chunked prefill).
"""

import pytest
import torch
from models import ARCHS, make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.testing import greedy_parity

LENGTHS = [1, 3, 9, 17, 33, 64, 5, 40]
NEW_TOKENS = 24


def pick_eos(model, prompts):
    """A token that the reference emits mid-way for some prompt, so eos stopping is exercised."""
    free_run = reference_generate(model, prompts[:4], max_new_tokens=12, do_sample=False, eos_token_id=None)
    for ids in free_run:
        if len(set(ids)) > 3:
            return ids[6]
    return free_run[0][6]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_parity_with_preemption_and_chunked_prefill(arch):
    model = make_model(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    eos = pick_eos(model, prompts)
    expected = reference_generate(model, prompts, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)

    # continuations must actually vary, or parity proves nothing
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2, expected
    assert any(len(e) < NEW_TOKENS for e in expected), "eos never stopped a prompt mid-way"

    hfpaged.patch(model, num_blocks=26, block_size=4, max_num_seqs=3, max_num_batched_tokens=24)
    results = model.generate_many(prompts, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos)

    assert [r.token_ids for r in results] == expected
    for r, e in zip(results, expected):
        assert r.finish_reason == ("stop" if e[-1] == eos else "length")
        assert r.text is None
    st = hfpaged.stats(model)
    assert st["num_preemptions"] > 0
    assert st["num_free_blocks"] == st["num_blocks"]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_parity_with_default_lengths_and_eos_list(arch):
    """No max_new_tokens: generate's default max_length=20 (+ prompt) applies; eos given as a list."""
    model = make_model(arch)
    prompts = random_prompts([2, 11, 30], seed=3)
    eos = [2, pick_eos(model, prompts)]
    expected = reference_generate(model, prompts, do_sample=False, eos_token_id=eos)
    hfpaged.patch(model, num_blocks=64, block_size=8)
    results = model.generate_many(prompts, do_sample=False, eos_token_id=eos)
    assert [r.token_ids for r in results] == expected


def test_parity_with_max_length_and_block_sizes():
    model = make_model("qwen3")
    prompts = random_prompts([6, 25, 47], seed=4)
    expected = reference_generate(model, prompts, max_length=60, do_sample=False, eos_token_id=None)
    for block_size in (1, 16, 64):
        hfpaged.patch(model, block_size=block_size, num_blocks=max(4, 600 // block_size))
        results = model.generate_many(prompts, max_length=60, do_sample=False, eos_token_id=None)
        assert [r.token_ids for r in results] == expected, block_size
        assert [len(p) + len(r.token_ids) for p, r in zip(prompts, results)] == [60, 60, 60]


def test_repeated_prompts_and_many_requests_through_a_tiny_pool():
    model = make_model("llama", seed=5)
    prompts = random_prompts([7] * 4 + [19] * 4 + [1] * 4, seed=6)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    hfpaged.patch(model, num_blocks=12, block_size=4, max_num_seqs=5, max_num_batched_tokens=16)
    results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert hfpaged.stats(model)["num_preemptions"] > 0


def test_bfloat16_model_runs_and_first_tokens_match():
    model = make_model("llama", dtype=torch.bfloat16)
    prompts = random_prompts([4, 12], seed=7)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    results = model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    assert [r.token_ids[0] for r in results] == [e[0] for e in expected]


def test_benchmark_parity_report_is_exact_in_float32():
    """hfpaged.testing.greedy_parity (benchmark.py --sections parity, quickstart.py --parity): in float32 every prompt matches, and so does its yardstick."""
    model = make_model("llama")
    report = greedy_parity(model, num_prompts=6, new_tokens=12)
    assert report["dtype"] == "torch.float32" and report["prompts"] == 6
    assert report["share_all_match"] == report["share_first_match"] == 1.0
    assert report["mean_matching_prefix"] == 12
    assert report["stock_eager_vs_sdpa"]["share_all_match"] == 1.0
    assert not hasattr(model, "_hfpaged") and model.config._attn_implementation == "sdpa"

    # given prompts and the model's own eos (what examples/quickstart.py --parity does with a real model)
    prompts = random_prompts([4, 9, 15, 22], seed=8)
    model.generation_config.eos_token_id = pick_eos(model, prompts)
    report = greedy_parity(model, prompts, new_tokens=12, stop_at_eos=True)
    assert report["prompts"] == 4 and report["share_all_match"] == 1.0
    assert report["mean_matching_prefix"] < 12  # some prompt stopped on eos before 12 tokens
