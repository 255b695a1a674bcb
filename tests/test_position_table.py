"""Models with a learned absolute position table (GPT-2's ``wpe``, OPT's ``embed_positions`` with its offset of 2).

Stock ``generate`` raises ``IndexError`` for a request that forwards a token past the table, and completes one that
stops (eos, length) before. A paged step packs many requests: the request past the table must fail alone, with an
``IndexError`` naming it, while the others (other callers' too) complete as in stock, and no step may hold the
token past the table (an overlapped step planned ahead included: on CUDA it is a device-side assert).
"""

import threading

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.model.kv_cache import position_table

POSITIONS = 40
ARCHS = ["gpt2", "opt"]
PAST = r"runs past the model's learned position table: its next token is at position 40, .* positions 0-39 only"


def tiny(arch, seed=3):
    size = {"gpt2": "n_positions", "opt": "max_position_embeddings"}[arch]
    return make_model(arch, seed=seed, **{size: POSITIONS})


def assert_pool_free(model):
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"], st


def long_and_short():
    return random_prompts([30, 5, 9], seed=8)  # 30 + 15 new tokens run past 40 positions; the others fit


@pytest.mark.parametrize("arch", ARCHS + ["llama"])
def test_a_learned_position_table_is_found_at_patch(arch):
    if arch == "llama":  # RoPE: no table
        assert position_table(make_model("llama", max_position_embeddings=POSITIONS)) is None
        return
    positions, which = position_table(tiny(arch))
    assert positions == POSITIONS
    assert (
        which == {"gpt2": "transformer.wpe, 40 rows", "opt": "model.decoder.embed_positions, 42 rows, offset 2"}[arch]
    )


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_request_past_the_table_fails_alone_and_the_others_equal_stock(arch, async_scheduling):
    model = tiny(arch)
    long, *others = long_and_short()
    with pytest.raises(IndexError):  # stock, on the long prompt alone
        reference_generate(model, [long], max_new_tokens=15, do_sample=False, eos_token_id=None)
    expected = reference_generate(model, others, max_new_tokens=15, do_sample=False, eos_token_id=None)
    hfpaged.patch(model, num_blocks=40, block_size=4, async_scheduling=async_scheduling)
    engine = hfpaged.Engine(model)
    ids = [engine.add_request(p, max_new_tokens=15, do_sample=False, eos_token_id=None) for p in [long, *others]]
    requests = [engine.core.scheduler.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    failed, *done = requests
    assert [r.output_token_ids for r in done] == expected
    assert [r.finish_reason for r in done] == ["length", "length"]
    assert failed.finish_reason == "error" and isinstance(failed.exception, IndexError)
    assert f"request {ids[0]!r} runs past" in failed.error
    assert len(failed.all_token_ids) == POSITIONS + 1  # its last token, at position 40, was never forwarded
    assert_pool_free(model)
    # generate_many raises stock's error type, naming the prompt
    with pytest.raises(IndexError, match="prompt 0 " + PAST):
        model.generate_many([long, *others], max_new_tokens=15, do_sample=False, eos_token_id=None)
    assert_pool_free(model)
    got = model.generate_many(others, max_new_tokens=15, do_sample=False, eos_token_id=None)
    assert [r.token_ids for r in got] == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_another_caller_sharing_the_steps_is_unaffected(arch):
    """A handle's request runs past the table in the same steps as another caller's generate_many (and threads)."""
    model = tiny(arch)
    long, *others = long_and_short()
    expected = reference_generate(model, others, max_new_tokens=15, do_sample=False, eos_token_id=None)
    hfpaged.patch(model, num_blocks=40, block_size=4)
    engine = hfpaged.Engine(model)
    engine.add_request(long, max_new_tokens=15, do_sample=False, eos_token_id=None)
    # generate_many's steps carry the handle's request too: its failure is the handle's alone
    got = model.generate_many(others, max_new_tokens=15, do_sample=False, eos_token_id=None)
    assert [r.token_ids for r in got] == expected
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "error" and "IndexError: request" in outputs[-1].error
    assert_pool_free(model)

    results, errors = {}, {}

    def caller(name, prompts):
        try:
            results[name] = [
                r.token_ids for r in model.generate_many(prompts, max_new_tokens=15, do_sample=False, eos_token_id=None)
            ]
        except Exception as error:
            errors[name] = error

    for _ in range(3):
        results.clear()
        errors.clear()
        threads = [threading.Thread(target=caller, args=(n, p)) for n, p in (("long", [long]), ("short", others))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert results == {"short": expected} and list(errors) == ["long"], (results, errors)
        assert isinstance(errors["long"], IndexError)
        assert_pool_free(model)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_request_that_stops_at_the_tables_end_completes_as_in_stock(arch, async_scheduling):
    """Its last token sits at position 40 (never forwarded): an eos there, or max_new_tokens ending there."""
    model = tiny(arch)
    long, *others = long_and_short()
    free = reference_generate(model, [long], max_new_tokens=11, do_sample=False, eos_token_id=None)[0]
    eos = free[-1]  # the token at position 40
    assert eos not in free[:-1]
    prompts = [long, *others]
    expected = reference_generate(model, prompts, max_new_tokens=15, do_sample=False, eos_token_id=eos)
    assert expected[0] == free
    hfpaged.patch(model, num_blocks=40, block_size=4, async_scheduling=async_scheduling)
    got = model.generate_many(prompts, max_new_tokens=15, do_sample=False, eos_token_id=eos)
    assert [r.token_ids for r in got] == expected
    got = model.generate_many(prompts, max_new_tokens=11, do_sample=False, eos_token_id=None)
    assert got[0].token_ids == free and got[0].finish_reason == "length"
    assert_pool_free(model)


@pytest.mark.parametrize("settings", [dict(num_beams=2), dict(do_sample=True, num_return_sequences=2, seed=0)])
def test_beams_and_samples_past_the_table_fail_with_the_index_error(settings):
    model = tiny("gpt2")
    long, *others = long_and_short()
    hfpaged.patch(model, num_blocks=60, block_size=4)
    with pytest.raises(IndexError, match="prompt 1 " + PAST):
        model.generate_many([others[0], long], max_new_tokens=15, eos_token_id=None, **settings)
    assert_pool_free(model)


def test_a_rope_model_still_runs_past_max_position_embeddings():
    model = make_model("llama", seed=3, max_position_embeddings=16)
    prompts = random_prompts([12, 5], seed=7)
    expected = reference_generate(model, prompts, max_new_tokens=20, do_sample=False, eos_token_id=None)
    hfpaged.patch(model, num_blocks=40, block_size=4)
    assert model._hfpaged.position_table is None
    got = model.generate_many(prompts, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert [r.token_ids for r in got] == expected
    assert_pool_free(model)


def test_prompts_longer_than_the_positions_a_rope_model_serves_a_table_refuses():
    # stock generate serves a RoPE model's prompt longer than max_position_embeddings; a prompt longer than a learned
    # table makes its forward raise IndexError: only the table refuses it up front (a probe found RoPE ones refused)
    rope = make_model("llama", seed=3, max_position_embeddings=16)
    prompts = random_prompts([23, 5], seed=9)
    expected = reference_generate(rope, prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    hfpaged.patch(rope, num_blocks=40, block_size=4)
    got = rope.generate_many(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert [r.token_ids for r in got] == expected
    assert_pool_free(rope)
    table = tiny("gpt2")
    hfpaged.patch(table, num_blocks=40, block_size=4)
    with pytest.raises(ValueError, match=r"prompt 0 has 41 tokens, more than the model's maximum of 40 positions "
                                         r"\(its learned position table, transformer.wpe, 40 rows\)"):  # fmt: skip
        table.generate_many(random_prompts([41], seed=2), max_new_tokens=2)
    assert_pool_free(table)


def test_a_table_smaller_than_the_config_says_ends_where_its_rows_do():
    # a position table of 24 rows in a model whose config says 32 positions (a probe): found by its rows, so the
    # request running past it fails alone instead of failing every step of every caller
    model = make_model("gpt2", seed=3, n_positions=32)
    model.transformer.wpe = torch.nn.Embedding(24, model.config.n_embd)
    short, long = random_prompts([5, 20], seed=4)
    expected = reference_generate(model, [short], max_new_tokens=6, do_sample=False, eos_token_id=None)
    hfpaged.patch(model, num_blocks=40, block_size=4)
    assert model._hfpaged.position_table == (24, "transformer.wpe, 24 rows")
    engine = hfpaged.Engine(model)
    engine.add_request(long, max_new_tokens=10, do_sample=False, eos_token_id=None)
    got = model.generate_many([short], max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert [r.token_ids for r in got] == expected
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "error" and "positions 0-23 only" in outputs[-1].error
    assert_pool_free(model)
