"""Every deterministic logits processor, user processors/criteria and per-prompt settings: token-exact
with stock ``generate`` (float32, greedy, each prompt run alone), through a pool small enough to preempt."""

import warnings

import pytest
import torch
from models import generate_in_threads, make_model, random_prompts, reference_generate
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

import hfpaged

NEW = 12


@pytest.fixture(scope="module")
def model():
    m = make_model("llama")
    # 14 blocks of 4 for three requests of up to 25 tokens: preemption happens in most runs
    hfpaged.patch(m, num_blocks=14, block_size=4, max_num_batched_tokens=24)
    return m


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([5, 9, 13], seed=1)


@pytest.fixture(scope="module")
def plain(model, prompts):
    out = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    assert all(len(set(o)) > 3 for o in out if len(o) == NEW)  # the continuations vary
    return out


def settings(plain):
    """Processor settings chosen from the plain greedy output so that each one changes it."""
    e0, e1 = plain[0][2], plain[1][3]  # tokens greedy would emit early: make them eos
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "repetition_reward": dict(repetition_penalty=0.5),
        "encoder_repetition_penalty": dict(encoder_repetition_penalty=2.0),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=1),
        "bad_words_ids": dict(bad_words_ids=[[plain[0][0]], [plain[1][1], plain[1][2]], [plain[2][4]]]),
        "sequence_bias": dict(
            sequence_bias={(plain[0][0],): -10.0, (plain[2][3], 7): 30.0, (plain[1][1], plain[1][2]): -50.0}
        ),
        "min_length": dict(min_length=16, eos_token_id=[e0, e1]),
        "min_new_tokens": dict(min_new_tokens=8, eos_token_id=[e0, e1]),
        "suppress_tokens": dict(suppress_tokens=[plain[0][1], plain[1][0], plain[2][2]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[plain[0][0], plain[1][0], plain[2][0]]),
        "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 1.6), eos_token_id=[e0, e1, 50]),
        "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.3),
        "forced_eos_token_id": dict(forced_eos_token_id=5, max_new_tokens=6),
        "eos_token_id_list": dict(eos_token_id=[e0, e1]),
        "max_length": dict(max_length=14, max_new_tokens=None),
        "stacked": dict(
            repetition_penalty=1.2, no_repeat_ngram_size=2, suppress_tokens=[plain[2][2]], min_new_tokens=3
        ),
    }


NAMES = [
    "repetition_penalty",
    "repetition_reward",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "min_length",
    "min_new_tokens",
    "suppress_tokens",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "renormalize_logits",
    "forced_eos_token_id",
    "eos_token_id_list",
    "max_length",
    "stacked",
]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_processor_matches_stock_generate(model, prompts, plain, name):
    kwargs = dict(max_new_tokens=NEW, do_sample=False)
    kwargs.update(settings(plain)[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference_generate(model, prompts, **kwargs)
        got = [r.token_ids for r in model.generate_many(prompts, **kwargs)]
    assert got == expected
    assert got != plain  # the setting had an effect, so the comparison proves something


def test_each_prompt_gets_its_own_settings_in_one_batch(model, prompts, plain):
    table = settings(plain)
    names = [
        "repetition_penalty",
        "min_new_tokens",
        "bad_words_ids",
        "no_repeat_ngram_size",
        "sequence_bias",
        "max_length",
    ]
    batch = [{"prompt": prompts[i % 3], **table[name]} for i, name in enumerate(names)]
    batch.append(prompts[0])  # plain greedy alongside
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [r.token_ids for r in model.generate_many(batch, max_new_tokens=NEW, do_sample=False)]
        for i, name in enumerate(names):
            kwargs = {**dict(max_new_tokens=NEW, do_sample=False), **table[name]}
            assert got[i] == reference_generate(model, [prompts[i % 3]], **kwargs)[0], name
    assert got[-1] == plain[0]


def test_generation_config_list_and_dict_precedence(model, prompts, plain):
    configs = [
        GenerationConfig(repetition_penalty=1.5, max_new_tokens=4),
        None,
        GenerationConfig(no_repeat_ngram_size=1, max_new_tokens=NEW),
    ]
    # call kwargs apply over each prompt's config; a prompt dict's own settings win over the call's
    batch = [prompts[0], prompts[1], {"prompt": prompts[2], "no_repeat_ngram_size": 2}]
    got = [r.token_ids for r in model.generate_many(batch, configs, do_sample=False, max_new_tokens=NEW)]
    assert (
        got[0]
        == reference_generate(model, [prompts[0]], generation_config=configs[0], max_new_tokens=NEW, do_sample=False)[0]
    )
    assert got[1] == plain[1]
    assert (
        got[2]
        == reference_generate(
            model,
            [prompts[2]],
            generation_config=configs[2],
            no_repeat_ngram_size=2,
            max_new_tokens=NEW,
            do_sample=False,
        )[0]
    )
    with pytest.raises(ValueError, match="list of 2 configs for 3 prompts"):
        model.generate_many(prompts, configs[:2])
    with pytest.raises(ValueError, match="without a 'prompt' key"):
        model.generate_many([{"max_new_tokens": 3}])


class BanSuccessor(LogitsProcessor):
    """History-dependent: forbid (last token + 1) % vocab and every token seen twice."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(input_ids.shape[0]):
            ids = input_ids[row]
            scores[row, (int(ids[-1]) + 1) % scores.shape[-1]] = -float("inf")
            counts = torch.bincount(ids, minlength=scores.shape[-1])[: scores.shape[-1]]
            scores[row, counts >= 2] = -float("inf")
        return scores


class StopAfterSum(StoppingCriteria):
    """Stop when the ids generated after ``prompt_len`` sum past a threshold (uses the full ids)."""

    def __init__(self, threshold):
        self.threshold = threshold

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -4:].sum(dim=-1) > self.threshold


def test_user_processor_and_criteria_see_their_own_request_ids(model, prompts, plain):
    kwargs = dict(
        max_new_tokens=NEW,
        do_sample=False,
        logits_processor=LogitsProcessorList([BanSuccessor()]),
        stopping_criteria=StoppingCriteriaList([StopAfterSum(260)]),
        repetition_penalty=1.2,  # built-in processors run before the user's, as in generate
    )
    expected = reference_generate(model, prompts, **kwargs)
    results = model.generate_many(prompts, **kwargs)
    assert [r.token_ids for r in results] == expected
    assert expected != plain and any(len(e) < NEW for e in expected)
    assert all(r.finish_reason == ("stop" if len(r.token_ids) < NEW else "length") for r in results)


def test_a_user_criterion_of_a_built_in_type_replaces_generates_own(model, prompts, plain):
    # generate merges a user MaxLengthCriteria / EosTokenCriteria in place of its own (before: generate_many kept
    # its max_length and eos besides the user's, and stopped early)
    from transformers import EosTokenCriteria, MaxLengthCriteria

    longer = StoppingCriteriaList([MaxLengthCriteria(max_length=len(prompts[0]) + NEW + 6)])
    kwargs = dict(max_new_tokens=NEW, do_sample=False, stopping_criteria=longer)
    expected = reference_generate(model, prompts[:1], **kwargs)
    assert len(expected[0]) == NEW + 6
    assert [r.token_ids for r in model.generate_many(prompts[:1], **kwargs)] == expected
    other_eos = plain[1][3]  # greedy emits it early: stop there instead of at the model's eos
    kwargs = dict(
        max_new_tokens=NEW, do_sample=False, stopping_criteria=StoppingCriteriaList([EosTokenCriteria(other_eos)])
    )
    expected = reference_generate(model, prompts, **kwargs)
    results = model.generate_many(prompts, **kwargs)
    assert [r.token_ids for r in results] == expected and expected[1] == plain[1][:4]
    assert [r.finish_reason for r in results] == ["stop" if e[-1] == other_eos else "length" for e in expected]
    assert generate_in_threads(model, prompts, **kwargs) == [[e] for e in expected]  # three callers at once


class CountThenRaise(StoppingCriteria):
    """Counts its calls and raises once the ids reach ``raise_at`` tokens (never stops by itself)."""

    def __init__(self, raise_at=None):
        self.raise_at, self.calls = raise_at, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.raise_at is not None and input_ids.shape[-1] >= self.raise_at:
            raise RuntimeError("criterion raised at the eos step")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_user_criterion_runs_and_raises_at_the_eos_step(model, prompts, plain):
    # generate's StoppingCriteriaList runs every criterion at every step, the one that emits eos included, and raises
    # what a criterion raises (before: generate_many stopped at eos without calling the user's criteria, so their
    # error was dropped and a stateful criterion was called one time fewer)
    eos = plain[1][3]  # greedy emits it as the 4th token
    kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    stock, ours = CountThenRaise(), CountThenRaise()
    expected = reference_generate(model, prompts[1:2], stopping_criteria=StoppingCriteriaList([stock]), **kwargs)
    results = model.generate_many(prompts[1:2], stopping_criteria=StoppingCriteriaList([ours]), **kwargs)
    assert [r.token_ids for r in results] == expected and expected[0] == plain[1][:4]
    assert results[0].finish_reason == "stop" and ours.calls == stock.calls == 4
    at_eos = len(prompts[1]) + 4
    with pytest.raises(RuntimeError, match="at the eos step"):
        reference_generate(
            model, prompts[1:2], stopping_criteria=StoppingCriteriaList([CountThenRaise(at_eos)]), **kwargs
        )
    with pytest.raises(RuntimeError, match="at the eos step"):
        model.generate_many(prompts[1:2], stopping_criteria=StoppingCriteriaList([CountThenRaise(at_eos)]), **kwargs)


def test_prefix_allowed_tokens_fn_with_several_sampled_sequences_per_prompt(model, prompts):
    # transformers >= 5.2x builds the processor for a prompt's n rows at once (num_beams = n); hfpaged calls it with
    # one sequence's row: it raised (1 // n = 0 rows per prompt)
    def allowed(batch_id, input_ids):
        return [10 + batch_id, 20 + batch_id]

    results = model.generate_many(
        prompts, max_new_tokens=3, do_sample=True, seed=0, num_return_sequences=2, prefix_allowed_tokens_fn=allowed
    )
    for i, result in enumerate(results):
        assert len(result.sequences) == 2
        assert all(t in (10 + i, 20 + i) for sequence in result.sequences for t in sequence.token_ids)


def test_a_stateful_watermark_processor_is_private_to_each_sampled_sequence(model, prompts):
    # SynthID's processor keeps each row's context: generate calls it once per step with a prompt's n rows. hfpaged
    # calls it per sequence: shared, the n sequences mixed their contexts (wrong distributions from the second
    # token on). Sequence 1 of n = 2 must be what one sequence with sequence 1's seed gives.
    from transformers import SynthIDTextWatermarkingConfig

    from hfpaged.sampling.parallel_sampling import sample_seed

    def watermark():
        return SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57, 29], ngram_len=3)

    kwargs = dict(max_new_tokens=6, do_sample=True, return_logprobs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pair = model.generate_many(
            prompts[:1], seed=1, num_return_sequences=2, watermarking_config=watermark(), **kwargs
        )
        alone = model.generate_many(prompts[:1], seed=sample_seed(1, 1), watermarking_config=watermark(), **kwargs)
    assert pair[0].sequences[1].token_ids == alone[0].token_ids
    assert torch.allclose(torch.tensor(pair[0].sequences[1].logprobs), torch.tensor(alone[0].logprobs), atol=1e-5)


def test_prefix_allowed_tokens_fn_gets_the_prompt_index(model, prompts):
    seen, seen_by_stock = set(), set()

    def allowed(batch_id, input_ids):
        seen.add(batch_id)
        return [t for t in range(3, 40) if (t + int(input_ids[-1])) % 3 == 0]

    def stock_allowed(batch_id, input_ids):
        seen_by_stock.add(batch_id)
        return allowed(batch_id, input_ids)

    got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6, prefix_allowed_tokens_fn=allowed)]
    expected = reference_generate(model, prompts, max_new_tokens=6, prefix_allowed_tokens_fn=stock_allowed)
    assert got == expected
    assert seen == {0, 1, 2} and seen_by_stock == {0}  # batch_id is the prompt's position, as in a batched generate
    assert all((t + p) % 3 == 0 for q, g in zip(prompts, got) for p, t in zip([q[-1]] + g, g))


class VllmAdjustments(LogitsProcessor):
    """Reference for hfpaged's presence/frequency/logit_bias: vLLM's formulas over generated ids."""

    def __init__(self, prompt_len, presence, frequency, bias):
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1]).to(scores.dtype)
        scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        for token_id, value in self.bias.items():
            scores[:, token_id] += value
        return scores


def test_presence_frequency_and_logit_bias_follow_vllm_semantics(model, prompts, plain):
    bias = {plain[0][3]: -100.0, 17: 2.5}
    extras = dict(presence_penalty=0.8, frequency_penalty=0.6, logit_bias=bias)
    got = model.generate_many(prompts, max_new_tokens=NEW, do_sample=False, repetition_penalty=1.1, **extras)
    for prompt, result in zip(prompts, got):
        reference = VllmAdjustments(len(prompt), 0.8, 0.6, bias)
        expected = reference_generate(
            model,
            [prompt],
            max_new_tokens=NEW,
            do_sample=False,
            repetition_penalty=1.1,
            logits_processor=LogitsProcessorList([reference]),
        )[0]
        assert result.token_ids == expected
    assert [r.token_ids for r in got] != plain
    # per prompt, and validated
    per_prompt = model.generate_many(
        [{"prompt": prompts[0], "logit_bias": {plain[0][0]: -1e9}}, prompts[0]], max_new_tokens=3, do_sample=False
    )
    assert per_prompt[0].token_ids[0] != plain[0][0] and per_prompt[1].token_ids == plain[0][:3]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.generate_many(prompts, logit_bias={10_000: 1.0})
    with pytest.raises(ValueError, match="presence_penalty must be a finite number"):
        model.generate_many(prompts, presence_penalty=float("nan"))


def test_max_time_stops_from_arrival(model, prompts):
    results = model.generate_many(prompts, max_new_tokens=NEW, max_time=0.0)
    assert [r.token_ids for r in results] == reference_generate(model, prompts, max_new_tokens=NEW, max_time=0.0)
    assert all(len(r.token_ids) == 1 and r.finish_reason == "time" for r in results)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(assistant_model=object()), "assistant_model"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(negative_prompt_ids=torch.tensor([[1]])), "negative_prompt_ids"),
        (dict(num_beams=2, return_logprobs=True), "return_logprobs with num_beams"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "group beam search"),
        (dict(attention_mask=torch.ones(1, 5)), "attention_mask"),
        (dict(past_key_values=DynamicCache()), "past_key_values= .the paged KV cache is managed by hfpaged"),
        (dict(cache=DynamicCache()), "cache= .the paged KV cache is managed by hfpaged"),
        (dict(output_scores=True, return_dict_in_generate=True), "return_logprobs"),
        (dict(num_return_sequences=2), "Greedy methods .* .num_return_sequences. different than 1"),
        (
            dict(num_beams=2, num_return_sequences=3),
            "num_return_sequences. .3. has to be smaller or equal to .num_beams",
        ),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(stop_strings=["ab"]), "no tokenizer is known"),
    ],
)
def test_unsupported_settings_raise_clearly(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate_many(prompts, max_new_tokens=3, **kwargs)


def test_engine_add_request_takes_the_same_settings(model, prompts, plain):
    engine = hfpaged.Engine(model)
    bias = {plain[0][1]: -1e9}
    first = engine.add_request(prompts[0], max_new_tokens=6, do_sample=False, logit_bias=bias, return_logprobs=True)
    second = engine.add_request(prompts[1], GenerationConfig(max_new_tokens=4, repetition_penalty=1.5))
    gained = {first: [], second: []}
    logprobs = []
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id] += out.new_token_ids
            assert out.token_ids == gained[out.request_id]
            if out.request_id == first:
                logprobs += out.new_logprobs
            else:
                assert out.new_logprobs is None
    expected = model.generate_many([{"prompt": prompts[0], "logit_bias": bias}], max_new_tokens=6, do_sample=False)[0]
    assert gained[first] == expected.token_ids and gained[first][1] != plain[0][1] and len(logprobs) == 6
    assert (
        gained[second]
        == reference_generate(model, prompts[1:2], max_new_tokens=4, repetition_penalty=1.5, do_sample=False)[0]
    )
    with pytest.raises(ValueError, match="streamer"):
        engine.add_request(prompts[0], streamer=object())


@pytest.mark.parametrize("flag", ["output_scores", "output_logits", "output_attentions", "output_hidden_states"])
def test_output_flags_without_return_dict_are_ignored_as_stock_does(model, prompts, flag):
    # a checkpoint's generation_config may carry them; stock generate ignores them unless return_dict_in_generate
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False, **{flag: True})[0, len(p) :].tolist()
        for p in prompts
    ]
    got = model.generate_many(prompts, max_new_tokens=3, do_sample=False, **{flag: True})
    assert [r.token_ids for r in got] == expected
