"""Seeded, bounded randomized differential test: random mixes of prompts and settings through random
engine configurations must give exactly what stock ``generate`` gives (greedy and beam search, float32),
and seeded samples exactly what the same request samples alone.

Each case draws: prompt lengths (with or without a shared prefix), per-prompt output lengths, an eos that
stops some prompts mid-way, a pool that may be far too small (preemption), a token budget (chunked
prefill), max_num_seqs, recompute or swap preemption, overlapped steps on or off, prefix caching on or off,
and a beam-search prompt or seeded-sampling prompts mixed in.
"""

import random

import pytest
import torch
from models import VOCAB, make_model

import hfpaged

# cases 126 and 156 swap a request out in a step that schedules nothing else, with overlapped steps: the
# swap-out copy was skipped and the request resumed from garbage KV (found by running 300 cases)
CASES = [*range(22), 126, 156]
ARCHS = ("llama", "qwen3", "gpt2")


def stock(model, prompt, **settings):
    """Stock generate on one prompt: the generated ids of every returned sequence (beams: each at its length)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), return_dict_in_generate=True, **settings)
    sequences = out.sequences[:, len(prompt) :].tolist()
    if out.get("beam_indices") is None:
        return sequences
    lengths = (out.beam_indices != -1).sum(dim=-1).tolist()
    return [ids[:n] for ids, n in zip(sequences, lengths)]


def draw_case(seed, archs=ARCHS):
    rng = random.Random(seed)
    num_prompts = rng.randint(2, 8)
    prefix = [rng.randrange(3, VOCAB) for _ in range(rng.choice([0, 0, 5, 12, 21]))]
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(num_prompts)]
    kinds = ["greedy"] * num_prompts
    if rng.random() < 0.35:
        kinds[rng.randrange(num_prompts)] = "beams"
    for i in range(num_prompts):
        if kinds[i] == "greedy" and rng.random() < 0.25:
            kinds[i] = "sampled"
    new_tokens = [rng.randint(1, 14) for _ in range(num_prompts)]
    block_size = rng.choice([1, 2, 4, 8, 16])
    longest = max(len(p) + n for p, n in zip(prompts, new_tokens))
    min_blocks = -(-longest // block_size) * (3 if "beams" in kinds else 1)
    engine = dict(
        block_size=block_size,
        num_blocks=rng.randint(min_blocks, 3 * min_blocks + 4),
        max_num_seqs=rng.randint(3 if "beams" in kinds else 1, 6),
        max_num_batched_tokens=rng.choice([4, 7, 16, 33, 64]),
        preemption_mode=rng.choice(["recompute", "swap"]),
        swap_space=rng.choice([None, 0.0005]),
        async_scheduling=rng.random() < 0.6,
        enable_prefix_caching=rng.random() < 0.7,
    )
    return dict(
        arch=archs[seed % len(archs)],
        prompts=prompts,
        kinds=kinds,
        new_tokens=new_tokens,
        eos_pick=rng.random(),
        engine=engine,
        seed=rng.randrange(2**31),
    )


_models: dict = {}


def model_for(arch):
    if arch not in _models:
        _models[arch] = make_model(arch, seed=5)
    model = _models[arch]
    hfpaged.unpatch(model)
    return model


def case_entries(model, c):
    """The case's requests (dicts for ``generate_many``) and each one's expected sequences: stock ``generate``'s
    for greedy and beam prompts; a sampled prompt's own samples alone in a roomy pool (default options)."""
    prompts, kinds, new_tokens = c["prompts"], c["kinds"], c["new_tokens"]
    # an eos that the free-running model emits mid-way for some prompt (or none at all)
    free = stock(model, prompts[0], max_new_tokens=8, do_sample=False, eos_token_id=None)[0]
    eos = free[int(c["eos_pick"] * len(free))] if c["eos_pick"] < 0.7 else None
    entries, expected = [], []
    for i, (prompt, kind, n) in enumerate(zip(prompts, kinds, new_tokens)):
        settings = dict(max_new_tokens=n, eos_token_id=eos)
        if kind == "beams":
            settings.update(num_beams=3, num_return_sequences=2, do_sample=False)
        elif kind == "sampled":
            settings.update(do_sample=True, top_k=6, temperature=0.8, seed=c["seed"] + i)
        else:
            settings.update(do_sample=False)
        entries.append({"prompt": prompt, **settings})
        expected.append(None if kind == "sampled" else stock_entry(model, entries[-1]))
    hfpaged.patch(model, num_blocks=256, block_size=16)
    for i, kind in enumerate(kinds):
        if kind == "sampled":
            expected[i] = [model.generate_many([entries[i]])[0].token_ids]
    return entries, expected


def stock_entry(model, entry):
    """Stock ``generate`` on a greedy or beam-search request dict."""
    settings = {k: v for k, v in entry.items() if k != "prompt"}
    return stock(model, entry["prompt"], pad_token_id=0, **settings)


def assert_pool_free(model):
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_free_cpu_blocks"] == st["num_cpu_blocks"], st


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_random_mixes_equal_stock_generate(case):
    c = draw_case(case)
    model = model_for(c["arch"])
    entries, expected = case_entries(model, c)
    hfpaged.patch(model, **c["engine"])
    results = model.generate_many(entries)
    got = [[s.token_ids for s in r.sequences] for r in results]
    assert got == expected, c
    assert_pool_free(model)
    hfpaged.unpatch(model)
