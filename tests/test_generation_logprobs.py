"""return_logprobs: each generated token's log-probability under the processed distribution equals what
stock ``generate`` + ``compute_transition_scores(..., normalize_logits=True)`` gives (float32, 1e-4)."""

import pytest
import torch
from models import make_model, random_prompts

import hfpaged


@pytest.fixture(scope="module")
def model():
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=14, block_size=4, max_num_batched_tokens=24)
    return m


def stock_scores(model, prompt, forced_tokens=None, monkeypatch=None, **kwargs):
    """Stock generate's tokens and transition scores; sampled steps take ``forced_tokens`` instead of drawing."""
    if forced_tokens is not None:
        queue = list(forced_tokens)
        monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples: torch.tensor([[queue.pop(0)]]))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), output_scores=True, return_dict_in_generate=True, **kwargs)
    if forced_tokens is not None:
        monkeypatch.undo()
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    return out.sequences[0, len(prompt) :].tolist(), scores.tolist(), out.scores


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=False),
        dict(do_sample=False, repetition_penalty=1.4, no_repeat_ngram_size=2),
        dict(do_sample=False, renormalize_logits=True, suppress_tokens=[5, 6, 7]),
    ],
)
def test_greedy_logprobs_match_compute_transition_scores(model, settings):
    prompts = random_prompts([5, 11, 8], seed=4)
    results = model.generate_many(prompts, max_new_tokens=10, return_logprobs=True, **settings)
    for prompt, result in zip(prompts, results):
        tokens, scores, _ = stock_scores(model, prompt, max_new_tokens=10, **settings)
        assert result.token_ids == tokens
        assert len(result.logprobs) == len(tokens)
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(scores), rtol=0, atol=1e-4)
        assert result.top_logprobs is None


@pytest.mark.parametrize(
    "settings",
    [
        dict(do_sample=True, temperature=0.7, top_k=10, top_p=0.9),
        dict(do_sample=True, repetition_penalty=1.3, typical_p=0.9, min_p=0.05),
    ],
)
def test_sampled_logprobs_match_compute_transition_scores_on_the_same_tokens(model, monkeypatch, settings):
    prompts = random_prompts([6, 9], seed=12)
    results = model.generate_many(prompts, max_new_tokens=10, seed=3, return_logprobs=True, top_logprobs=4, **settings)
    for prompt, result in zip(prompts, results):
        tokens, scores, raw = stock_scores(
            model, prompt, forced_tokens=result.token_ids, monkeypatch=monkeypatch, max_new_tokens=10, **settings
        )
        assert tokens == result.token_ids
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(scores), rtol=0, atol=1e-4)
        assert all(lp > float("-inf") for lp in result.logprobs)
        for step, top in enumerate(result.top_logprobs):
            expected = raw[step][0].log_softmax(-1)
            finite = int(torch.isfinite(expected).sum())
            values, ids = expected.topk(min(4, finite))
            assert list(top) == ids.tolist()  # most likely first, impossible tokens left out
            torch.testing.assert_close(torch.tensor(list(top.values())), values, rtol=0, atol=1e-4)


def test_logprobs_stream_with_tokens_and_are_per_request(model):
    prompts = random_prompts([5, 7], seed=2)
    batch = [{"prompt": prompts[0], "return_logprobs": True}, prompts[1]]
    results = model.generate_many(batch, max_new_tokens=6)
    assert len(results[0].logprobs) == len(results[0].token_ids) and results[1].logprobs is None
    events = list(model.stream_many(batch, max_new_tokens=6))
    streamed = [lp for e in events if e.index == 0 for lp in e.logprobs]
    assert [t for e in events if e.index == 0 for t in e.token_ids] == results[0].token_ids
    # the logits of a different packing agree to float32 rounding, not bit for bit
    torch.testing.assert_close(torch.tensor(streamed), torch.tensor(results[0].logprobs), rtol=0, atol=1e-5)
    assert all(e.logprobs is None for e in events if e.index == 1)
