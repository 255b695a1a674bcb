"""Engine.add_request's merged-config cache: the same configs as resolving afresh, and never a stale one."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate
from transformers import GenerationConfig

import hfpaged
from hfpaged.sampling.config_cache import ResolvedConfigCache
from hfpaged.sampling.params import resolve_generation_config


@pytest.fixture
def model():
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    return m


def same_config(a, b) -> bool:
    """Every attribute equal, the special-token tensors ``_prepare_special_tokens`` sets included."""
    da, db = vars(a.generation_config), vars(b.generation_config)
    if da.keys() != db.keys() or (a.has_default_max_length, a.has_default_min_length) != (
        b.has_default_max_length,
        b.has_default_min_length,
    ):
        return False
    for key, value in da.items():
        other = db[key]
        if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
            if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


SETTINGS = [
    {},
    {"max_new_tokens": 5},
    {"max_new_tokens": 9, "do_sample": False},
    {"max_new_tokens": 7, "do_sample": True, "temperature": 0.7, "top_p": 0.9},
    {"max_new_tokens": 7, "do_sample": True, "temperature": 1.3, "top_k": 5, "min_p": 0.05},
    {"max_new_tokens": 6, "repetition_penalty": 1.2},
    {"max_new_tokens": 6, "temperature": None, "top_k": None},
    {"do_sample": False, "temperature": 0.5},  # a sampling flag without sampling: transformers warns, still valid
    {"max_length": 20, "min_new_tokens": 2},
    {"max_new_tokens": 4, "num_beams": 2, "num_return_sequences": 2},
    {"max_new_tokens": 4, "eos_token_id": 7},
    {"max_new_tokens": 4, "eos_token_id": [7, 9]},  # lists are keyed by value
    {"max_new_tokens": 4, "stop_strings": ["ab", "c"], "bad_words_ids": [[5], [6, 7]]},
    {"max_new_tokens": 4, "sequence_bias": {(5,): -1.0}},
    {"max_new_tokens": 5.0},  # a float: applied per request as transformers applies it (update)
]


@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_cached_configs_equal_fresh_ones(model, settings):
    cache = ResolvedConfigCache()
    for _ in range(3):  # a miss, then hits
        assert same_config(cache.resolve(model, None, dict(settings)), resolve_generation_config(model, None, settings))
    assert cache.hits == 2 and cache.misses == 1
    gc = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=4)
    for _ in range(2):
        assert same_config(cache.resolve(model, gc, dict(settings)), resolve_generation_config(model, gc, settings))


def test_per_request_numbers_share_one_entry(model):
    cache = ResolvedConfigCache()
    for n in (3, 4, 5):
        for temperature in (0.5, 0.9):
            settings = {"max_new_tokens": n, "do_sample": True, "temperature": temperature, "top_p": 0.8}
            got = cache.resolve(model, None, dict(settings))
            assert same_config(got, resolve_generation_config(model, None, settings))
            assert got.generation_config.max_new_tokens == n and got.generation_config.temperature == temperature
    assert (cache.misses, cache.hits) == (1, 5)
    # the entry's own config was never changed by the requests' settings
    (entry,) = cache._entries.values()
    assert entry[2].generation_config.max_new_tokens is None and entry[2].generation_config.top_p != 0.8


def test_changed_configs_are_never_served_stale(model):
    cache = ResolvedConfigCache()
    settings = {"max_new_tokens": 4, "do_sample": True}

    def check():
        assert same_config(cache.resolve(model, None, dict(settings)), resolve_generation_config(model, None, settings))

    check()
    model.generation_config.top_k = 3  # an attribute set anew
    check()
    model.generation_config.eos_token_id = [2, 5]
    check()
    model.generation_config.eos_token_id.append(6)  # an edit in place
    check()
    assert cache.misses == 4 and cache.hits == 0
    check()
    assert cache.hits == 1
    # the caller's own config: edited in place, then another object with the same settings
    gc = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=4)
    first = cache.resolve(model, gc, {})
    gc.top_k = 9
    second = cache.resolve(model, gc, {})
    assert first.generation_config.top_k == 4 and second.generation_config.top_k == 9
    assert same_config(second, resolve_generation_config(model, gc, {}))
    del gc, first, second
    other = GenerationConfig(max_new_tokens=3, do_sample=True, top_k=4)  # may reuse the freed object's id
    assert same_config(cache.resolve(model, other, {}), resolve_generation_config(model, other, {}))


def test_list_settings_are_keyed_by_value_and_copied(model):
    cache = ResolvedConfigCache()
    eos = [7, 9]
    first = cache.resolve(model, None, {"max_new_tokens": 4, "eos_token_id": eos})
    eos.append(11)  # the caller reuses its list: neither the entry nor the next request sees the old value
    second = cache.resolve(model, None, {"max_new_tokens": 4, "eos_token_id": eos})
    assert first.generation_config.eos_token_id == [7, 9] and second.generation_config.eos_token_id == [7, 9, 11]
    third = cache.resolve(model, None, {"max_new_tokens": 4, "eos_token_id": [7, 9]})
    assert third.generation_config.eos_token_id == [7, 9] and (cache.misses, cache.hits) == (2, 1)
    assert cache.resolve(model, None, {"max_new_tokens": 4, "eos_token_id": (7, 9)}) is not None
    assert cache.misses == 3  # a tuple is another key than the list with the same items
    with pytest.raises(ValueError, match="unsupported arguments"):  # unhashable and unknown: resolved, refused
        cache.resolve(model, None, {"max_new_tokens": 4, "not_a_setting": torch.zeros(2)})


def test_bad_per_request_numbers_raise_as_before(model):
    cache = ResolvedConfigCache()
    cache.resolve(model, None, {"max_new_tokens": 4})
    for settings in ({"max_new_tokens": 0}, {"max_new_tokens": -3}):
        with pytest.raises(ValueError, match="max_new_tokens") as cached:
            cache.resolve(model, None, dict(settings))
        with pytest.raises(ValueError, match="max_new_tokens") as fresh:
            resolve_generation_config(model, None, settings)
        assert str(cached.value) == str(fresh.value)
    with pytest.raises(ValueError, match="unsupported arguments"):
        cache.resolve(model, None, {"max_new_tokens": 4, "not_a_setting": 1})
    ok = {"max_new_tokens": 4}
    assert same_config(cache.resolve(model, None, dict(ok)), resolve_generation_config(model, None, ok))


def run(engine, requests):
    ids = [engine.add_request(prompt, **settings) for prompt, settings in requests]
    gained = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id].extend(out.new_token_ids)
    return [gained[i] for i in ids]


def test_engine_tokens_follow_model_generation_config_changes(model):
    """Requests added one at a time with the same settings: tokens equal stock generate under the model's
    generation config as it is when each is added (a change between them is not hidden by the cache)."""
    engine = hfpaged.Engine(model)
    prompts = random_prompts([5, 8], seed=21)
    greedy = {"max_new_tokens": 6, "do_sample": False}
    assert run(engine, [(p, greedy) for p in prompts]) == reference_generate(model, prompts, **greedy)
    model.generation_config.repetition_penalty = 1.5
    expected = reference_generate(model, prompts, **greedy)
    assert run(engine, [(p, greedy) for p in prompts]) == expected
    model.generation_config.repetition_penalty = None
    assert run(engine, [(p, {**greedy, "max_new_tokens": n}) for p, n in zip(prompts, (3, 5))]) == [
        reference_generate(model, [p], **{**greedy, "max_new_tokens": n})[0] for p, n in zip(prompts, (3, 5))
    ]
    cache = engine.core.prompts.resolved_configs
    assert cache.hits >= 3
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(prompts[0], max_new_tokens=0)
    assert not engine.has_unfinished()
    assert run(engine, [(prompts[0], greedy)]) == reference_generate(model, prompts[:1], **greedy)
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cached_settings_under_preemption_two_callers_and_changed_weights(mode):
    """Requests added one at a time through two handles, each with its own max_new_tokens (one cache entry),
    in a pool so small that they preempt each other (recompute or swap), with overlapped steps: tokens equal
    stock generate, before and after a weight is changed in place."""
    model = make_model("llama", seed=11)
    hfpaged.patch(
        model,
        num_blocks=24,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        preemption_mode=mode,
        swap_space=0.01 if mode == "swap" else None,
    )
    prompts = random_prompts([9, 21, 14, 30, 6, 17], seed=61)
    news = [7, 12, 9, 15, 11, 8]
    first, second = hfpaged.Engine(model), hfpaged.Engine(model)

    def one_round():
        added = []
        for i, (prompt, n) in enumerate(zip(prompts, news)):
            handle = (first, second)[i % 2]
            added.append((handle, handle.add_request(prompt, max_new_tokens=n, do_sample=False)))
        gained = {rid: [] for _, rid in added}
        while first.has_unfinished() or second.has_unfinished():
            for handle in (first, second):
                for out in handle.step():
                    gained[out.request_id].extend(out.new_token_ids)
        return [gained[rid] for _, rid in added]

    def stock():
        return [reference_generate(model, [p], max_new_tokens=n, do_sample=False)[0] for p, n in zip(prompts, news)]

    before = stock()
    assert one_round() == before
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    after = stock()
    assert after != before
    assert one_round() == after
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swapped_out"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert first.core.num_overlapped_steps > 0
    cache = first.core.prompts.resolved_configs
    assert cache.misses == 1 and cache.hits == 2 * len(prompts) - 1


def test_settings_equal_in_value_but_not_in_type_or_identity_are_not_served_stale(model):
    """Generate tells ``early_stopping=True`` from ``1`` (``is True``), and a tensor setting edited in place is
    another setting: neither may reuse the entry made for the other (prompt dicts' settings go through the cache)."""
    prompt = random_prompts([9], seed=5)[0]
    beams = dict(max_new_tokens=15, num_beams=4, eos_token_id=9, length_penalty=2.0, do_sample=False)
    assert reference_generate(model, [prompt], early_stopping=1, **beams) != reference_generate(
        model, [prompt], early_stopping=True, **beams
    )  # a prompt where the two differ
    for first, second in [(1, True), (True, 1)]:
        model.generate_many([{"prompt": prompt, "early_stopping": first}], **beams)
        got = model.generate_many([{"prompt": prompt, "early_stopping": second}], **beams)[0].token_ids
        assert [got] == reference_generate(model, [prompt], early_stopping=second, **beams)
    greedy = dict(max_new_tokens=12, do_sample=False)
    free = reference_generate(model, [prompt], **greedy)[0]
    eos = torch.tensor([free[2]])
    for stop_at in (free[2], free[5]):
        eos[0] = stop_at  # the same tensor object, edited in place
        got = model.generate_many([{"prompt": prompt, "eos_token_id": eos}], **greedy)[0].token_ids
        assert [got] == reference_generate(model, [prompt], eos_token_id=torch.tensor([stop_at]), **greedy)


def test_the_freeze_key_keeps_types_apart_and_refuses_objects():
    from hfpaged.sampling.config_cache import _freeze

    assert len({_freeze(1), _freeze(True), _freeze(1.0)}) == 3
    assert _freeze({"a": [1, (2, None)]}) == _freeze({"a": [1, (2, None)]})
    for value in (torch.tensor([1]), object(), [torch.tensor(2)]):
        with pytest.raises(TypeError):
            _freeze(value)
