"""Sampling through the engine: seeds are reproducible, independent of batch companions and scheduling,
different seeds differ, and first tokens follow the distribution of transformers' processors and warpers."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate
from scipy import stats
from transformers.generation import logits_process as lp

import hfpaged

SAMPLING = dict(do_sample=True, temperature=0.9, top_k=12, top_p=0.95, min_p=0.02, min_new_tokens=10)


@pytest.fixture(scope="module")
def model():
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=12, block_size=4, max_num_batched_tokens=16)
    return m


@pytest.fixture(autouse=True)
def pool_is_free_after(model):
    yield
    stats_ = hfpaged.stats(model)
    assert stats_["num_free_blocks"] == stats_["num_blocks"]


def tokens(results):
    return [r.token_ids for r in results]


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    prompts = random_prompts([4, 7, 10], seed=5)
    a = tokens(model.generate_many(prompts, max_new_tokens=10, seed=11, **SAMPLING))
    b = tokens(model.generate_many(prompts, max_new_tokens=10, seed=11, **SAMPLING))
    c = tokens(model.generate_many(prompts, max_new_tokens=10, seed=12, **SAMPLING))
    assert a == b
    assert all(x != y for x, y in zip(a, c))
    assert all(len(set(x)) > 3 for x in a)  # continuations vary


def test_a_request_samples_the_same_whatever_shares_its_batch_and_however_it_is_scheduled(model):
    target = {"prompt": random_prompts([6], seed=8)[0], "seed": 1234, "max_new_tokens": 14}
    alone = model.generate_many([target], **SAMPLING)[0].token_ids
    before = hfpaged.stats(model)["num_preemptions"]
    companions = random_prompts([9, 3, 12, 5], seed=9)
    crowded = model.generate_many([companions[0], target, *companions[1:]], max_new_tokens=14, seed=7, **SAMPLING)
    assert crowded[1].token_ids == alone
    assert hfpaged.stats(model)["num_preemptions"] > before  # the crowded run was preempted and recomputed
    # the same again with history processors (row-wise path) and a different chunking of the prefill
    other = make_model("llama")
    hfpaged.patch(other, num_blocks=64, block_size=8, max_num_batched_tokens=5)
    # the decay starts after min_new_tokens: before, eos is -inf and 5.17's processor turns that into NaN (stock
    # generate raises there, and so does generate_many)
    with_penalty = dict(
        SAMPLING, repetition_penalty=0.5, no_repeat_ngram_size=2, exponential_decay_length_penalty=(10, 1.1)
    )
    x = model.generate_many([target, *companions], max_new_tokens=14, **with_penalty)[0].token_ids
    y = other.generate_many([*companions[:2], target], max_new_tokens=14, **with_penalty)[2].token_ids
    assert x == y and x != alone


class BanToken(lp.LogitsProcessor):
    """A user processor (so it runs on the exact row-wise path)."""

    def __init__(self, token_id):
        self.token_id = token_id

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token_id] = -float("inf")
        return scores


def first_token_probabilities(model, prompt, processors):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    return lp.LogitsProcessorList(processors)(torch.tensor([prompt]), logits[None])[0].softmax(-1)


@pytest.mark.parametrize(
    "settings,processors",
    [
        (dict(do_sample=True, temperature=0.8, top_k=15), [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(15)]),
        (
            dict(do_sample=True, repetition_penalty=2.0, top_k=10, logits_processor=[BanToken(2)]),
            [lp.RepetitionPenaltyLogitsProcessor(2.0), BanToken(2), lp.TopKLogitsWarper(10)],
        ),
    ],
)
def test_first_tokens_follow_transformers_distribution(settings, processors):
    """2,000 requests of one prompt with seeds 0..1999: chi-square p > 1e-4, TV < 0.06, nothing outside the support."""
    num = 2000
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=2 * num + 8, block_size=4, max_num_seqs=1024)
    prompt = random_prompts([5], seed=21)[0]
    results = m.generate_many([{"prompt": prompt, "seed": s} for s in range(num)], max_new_tokens=1, **settings)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=m.config.vocab_size).double()
    probs = first_token_probabilities(m, prompt, processors).double()
    allowed = probs > 0
    assert counts[~allowed].sum() == 0
    assert allowed.sum() > 3
    expected = probs[allowed] / probs[allowed].sum() * num
    assert stats.chisquare(counts[allowed].numpy(), expected.numpy()).pvalue > 1e-4
    assert 0.5 * (counts / num - probs).abs().sum() < 0.06
    assert hfpaged.stats(m)["num_free_blocks"] == hfpaged.stats(m)["num_blocks"]


def test_top_p_zero_keeps_the_top_token_as_stock_generate_does(model):
    # transformers' TopPLogitsWarper takes top_p in [0, 1]: 0 keeps the top token only, so stock generate samples
    # its greedy tokens; generate_many refused it ("top_p must be in (0, 1]")
    prompt = [5, 6, 7]
    with torch.no_grad():
        stock = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=True, top_p=0.0, pad_token_id=0)
    greedy = reference_generate(model, [prompt], max_new_tokens=6, do_sample=False)[0]
    assert stock[0, 3:].tolist() == greedy
    got = model.generate_many([prompt], max_new_tokens=6, do_sample=True, top_p=0.0, seed=0)[0].token_ids
    assert got == greedy
