"""The sampler on fixed logits: batched processors equal transformers' row by row, and sampled tokens
follow the distribution transformers' warpers define (statistical tests with stated tolerances)."""

from dataclasses import replace

import pytest
import torch
from scipy import stats
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from hfpaged.sampling.params import RequestParams
from hfpaged.sampling.processors import StageContext, plan_stages, run_stages
from hfpaged.sampling.request_state import CachedRequestState
from hfpaged.sampling.sampler import Sampler

VOCAB = 64


def make_request(processors, *, seed=0, do_sample=True, prompt=(5, 6, 7), output=(), return_logprobs=False):
    stages = plan_stages(lp.LogitsProcessorList(processors), user_processors=None, adjustments=[], vocab_size=VOCAB)
    params = RequestParams(
        generation_config=GenerationConfig(),
        max_length=10_000,
        eos_token_ids=frozenset(),
        do_sample=do_sample,
        seed=seed,
        stages=stages,
        return_logprobs=return_logprobs,
    )
    return CachedRequestState(f"r{seed}", params, list(prompt) + list(output), len(prompt))


def fixed_logits(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=gen) * 2.0


def hf_processed(processors, request, logits):
    ids = torch.tensor([request.all_token_ids])
    return lp.LogitsProcessorList(processors)(ids, logits[None].clone())[0]


WARPER_SETS = {
    "temperature": lambda: [lp.TemperatureLogitsWarper(0.7)],
    "top_k": lambda: [lp.TopKLogitsWarper(7)],
    "top_p": lambda: [lp.TopPLogitsWarper(0.8)],
    "min_p": lambda: [lp.MinPLogitsWarper(0.1)],
    "typical_p": lambda: [lp.TypicalLogitsWarper(0.7)],
    "epsilon_cutoff": lambda: [lp.EpsilonLogitsWarper(0.02)],
    "eta_cutoff": lambda: [lp.EtaLogitsWarper(0.05)],
    "temperature+top_k+top_p+min_p": lambda: [
        lp.TemperatureLogitsWarper(1.3),
        lp.TopKLogitsWarper(20),
        lp.TopPLogitsWarper(0.9),
        lp.MinPLogitsWarper(0.05),
    ],
    "temperature+typical+renormalize": lambda: [
        lp.TemperatureLogitsWarper(0.9),
        lp.TypicalLogitsWarper(0.9),
        lp.LogitNormalization(),
    ],
}


def test_rows_with_different_warpers_equal_transformers_row_by_row():
    names = list(WARPER_SETS)
    requests, processors, logits = [], [], []
    for i, name in enumerate(names * 2):  # every set twice, with different logits, in one batch
        procs = WARPER_SETS[name]()
        requests.append(make_request(procs, seed=i))
        processors.append(procs)
        logits.append(fixed_logits(i))
    batch = torch.stack(logits)
    got = run_stages(batch.clone(), requests, StageContext(VOCAB, batch.device))
    for row, (procs, request) in enumerate(zip(processors, requests)):
        expected = hf_processed(procs, request, batch[row])
        assert torch.equal(torch.isinf(got[row]), torch.isinf(expected)), names[row % len(names)]
        torch.testing.assert_close(got[row], expected, rtol=0, atol=1e-6)


HISTORY_SETS = {
    "repetition_penalty": lambda r: [lp.RepetitionPenaltyLogitsProcessor(1.7)],
    "repetition_reward": lambda r: [lp.RepetitionPenaltyLogitsProcessor(0.6)],
    "encoder_repetition_penalty": lambda r: [
        lp.EncoderRepetitionPenaltyLogitsProcessor(1.5, torch.tensor([r["prompt"]]))
    ],
    "no_repeat_ngram_2": lambda r: [lp.NoRepeatNGramLogitsProcessor(2)],
    "no_repeat_ngram_3": lambda r: [lp.NoRepeatNGramLogitsProcessor(3)],
    "sequence_bias": lambda r: [
        lp.SequenceBiasLogitsProcessor({(9,): -3.0, (7, 8): 4.0, (6, 7, 11): -2.5, (12, 3): 1.0})
    ],
    "bad_words": lambda r: [lp.NoBadWordsLogitsProcessor([[9], [7, 8], [8, 5, 13]], eos_token_id=2)],
    "min_length": lambda r: [lp.MinLengthLogitsProcessor(12, [2, 3])],
    "min_new_tokens": lambda r: [lp.MinNewTokensLengthLogitsProcessor(len(r["prompt"]), 5, [2, 4])],
    "suppress_tokens": lambda r: [lp.SuppressTokensLogitsProcessor([1, 5, 63, 200])],
    "begin_suppress_tokens": lambda r: [
        lp.SuppressTokensAtBeginLogitsProcessor([3, 4], len(r["prompt"]) + len(r["output"]))
    ],
    "stacked": lambda r: [
        lp.RepetitionPenaltyLogitsProcessor(1.3),
        lp.NoRepeatNGramLogitsProcessor(2),
        lp.MinNewTokensLengthLogitsProcessor(len(r["prompt"]), 9, [2]),
        lp.LogitNormalization(),
    ],
}


@pytest.mark.parametrize("num_steps", [1, 3])
def test_history_processors_equal_transformers_row_by_row(num_steps):
    """Rows with different histories and processors; several steps so incremental state is exercised."""
    gen = torch.Generator().manual_seed(3)
    rows = []
    for i, name in enumerate(list(HISTORY_SETS) * 2):
        prompt = torch.randint(3, 16, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        output = torch.randint(3, 16, (i % 5,), generator=gen).tolist()
        spec = {"prompt": prompt, "output": output}
        rows.append((name, spec, HISTORY_SETS[name](spec)))
    requests = [
        make_request(procs, seed=i, prompt=s["prompt"], output=s["output"]) for i, (_, s, procs) in enumerate(rows)
    ]
    context = StageContext(VOCAB, torch.device("cpu"))
    for step in range(num_steps):
        batch = torch.stack([fixed_logits(100 * step + i) for i in range(len(rows))])
        context.begin_step()
        got = run_stages(batch.clone(), requests, context)
        for row, ((name, _, procs), request) in enumerate(zip(rows, requests)):
            expected = hf_processed(procs, request, batch[row])
            assert torch.equal(got[row], expected), (name, step)
        for request in requests:  # every request gains a token, repeating one from its history
            request.all_token_ids.append(request.all_token_ids[-2])


def many_requests(processors, seeds, outputs):
    """Requests sharing one plan of (stateless) warpers, with their own seeds and outputs."""
    template = make_request(processors)
    return [make_request_like(template, seed, output) for seed, output in zip(seeds, outputs)]


def make_request_like(template, seed, output):
    prompt = template.token_ids[: template.num_prompt_tokens]
    return CachedRequestState(
        f"r{seed}-{len(output)}", replace(template.params, seed=seed), prompt + list(output), len(prompt)
    )


def sample(logits, requests, positions=None):
    """The sampler's picks by request id (``positions``: the noise counters, by default each request's length)."""
    positions = [r.num_tokens for r in requests] if positions is None else positions
    out = Sampler().sample(logits, requests, positions).result()
    logprobs = out.logprobs or [None] * len(out.request_ids)
    return {rid: (token, logprob) for rid, token, logprob in zip(out.request_ids, out.token_ids, logprobs)}


def sample_counts(requests, logits, positions=None):
    picks = sample(logits[None].expand(len(requests), -1).contiguous(), requests, positions)
    return torch.bincount(torch.tensor([picks[r.request_id][0] for r in requests]), minlength=VOCAB)


# The stated tolerance: a chi-square goodness-of-fit test over the allowed tokens must not reject at
# p < 1e-4, the total-variation distance must be below 0.02 (its expected value here is ~0.01), and no
# token outside the allowed set may ever appear. Seeds are fixed, so the outcome is deterministic.
NUM_SAMPLES = 20_000


def assert_matches(counts, probs):
    allowed = probs > 0
    assert counts[~allowed].sum() == 0, "sampled a token the warpers remove"
    observed = counts[allowed].double()
    expected = probs[allowed].double() / probs[allowed].double().sum() * NUM_SAMPLES
    if allowed.sum() > 1:
        assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4
    tv = 0.5 * (counts.double() / NUM_SAMPLES - probs.double()).abs().sum()
    assert tv < 0.02


@pytest.mark.parametrize("name", list(WARPER_SETS))
def test_sampled_tokens_follow_the_warped_distribution_across_seeds(name):
    logits = fixed_logits(7)
    requests = many_requests(WARPER_SETS[name](), range(NUM_SAMPLES), [()] * NUM_SAMPLES)
    probs = hf_processed(WARPER_SETS[name](), requests[0], logits).softmax(-1)
    assert 1 < (probs > 0).sum() < VOCAB or name in ("temperature",)
    assert_matches(sample_counts(requests, logits), probs)


def test_sampled_tokens_follow_the_distribution_across_positions_of_one_seed():
    logits = fixed_logits(8)
    procs = WARPER_SETS["temperature+top_k+top_p+min_p"]
    template = make_request(procs(), seed=123)
    requests = [make_request_like(template, 123, ()) for _ in range(NUM_SAMPLES)]
    for position, request in enumerate(requests):  # one seed, every noise counter
        request.request_id = f"p{position}"
    probs = hf_processed(procs(), template, logits).softmax(-1)
    assert_matches(sample_counts(requests, logits, positions=list(range(NUM_SAMPLES))), probs)


def test_greedy_rows_take_the_argmax_and_logprobs_are_of_the_processed_distribution():
    logits = torch.stack([fixed_logits(i) for i in range(4)])
    procs = [[], [lp.TopKLogitsWarper(5)], [lp.TemperatureLogitsWarper(0.5)], []]
    requests = [make_request(p, seed=i, do_sample=i % 2 == 1, return_logprobs=True) for i, p in enumerate(procs)]
    picks = sample(logits.clone(), requests)
    for row, request in enumerate(requests):
        token_id, logprob = picks[request.request_id]
        processed = hf_processed(procs[row], request, logits[row])
        if not request.params.do_sample:
            assert token_id == int(processed.argmax())
        expected = processed.log_softmax(-1)[token_id]
        assert abs(logprob - float(expected)) < 1e-6


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("vocab", [4096, 50257, 151936])
def test_row_argmax_equals_argmax_with_ties_and_ragged_vocab(vocab, device):
    from hfpaged.sampling.sampler import row_argmax

    gen = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):  # float64: not the Triton kernel's, torch's path
        scores = torch.randn(5, vocab, generator=gen).to(dtype).to(device)
        scores[1, 7] = scores[1, vocab - 1] = 40.0  # a tie across chunks: the first wins
        scores[2, vocab - 1] = 40.0  # the maximum in the last, partly padded chunk
        scores[3] = float("-inf")
        scores[4, 100:200] = 40.0  # a tie inside one chunk
        assert torch.equal(row_argmax(scores), scores.argmax(dim=-1))
