"""LongRoPE past its short length (hfpaged/model/long_rope.py): greedy tokens equal stock ``generate`` for prompts on
both sides of ``original_max_position_embeddings`` (L) and generation across it, in both of transformers' ways: Llama
rotates tokens past L long and keeps its short keys, Phi-3 recomputes the whole sequence long once it grows past L."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import transformers
from models import (
    LONGROPE,
    check_callers_and_changed_weights,
    generate_in_threads,
    make_model,
    random_prompts,
    reference_generate,
)
from packaging.version import Version

import hfpaged
from hfpaged.model.long_rope import LONG_POSITION, long_positions

L = LONGROPE["original_max_position_embeddings"]  # 16
# short prompts that cross L while decoding (one ends exactly at L, one starts decoding at L), long prompts
LENGTHS = [5, 10, 15, 16, 17, 26]
SETTINGS = dict(max_new_tokens=14, do_sample=False, eos_token_id=None)
MODELS = {"llama": {}, "phi3": dict(original_max_position_embeddings=L)}  # Phi3Config keeps L at the top level
# what generate does when a sequence grows past L (hf_compat.longrope_crossing): Phi-3 recomputes it long from
# transformers 5.20 on; 5.17-5.19 drop the cache but compute only the last token (hfpaged refuses those requests)
CROSSING = {"llama": "keep", "phi3": "recompute" if Version(transformers.__version__) >= Version("5.20") else "drop"}


def longrope_model(arch: str, seed: int = 0):
    return make_model(arch, seed, rope_parameters=dict(LONGROPE), max_position_embeddings=64, **MODELS[arch])


def expected_tokens(model, prompts):
    expected = reference_generate(model, prompts, **SETTINGS)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2  # the continuations vary
    return expected


def served(model, prompts, expected):
    """The prompts (and their expected tokens) a request of SETTINGS may run: all, except where generate computes
    a short prompt's continuation past L without context (those are refused, naming why, and leave nothing)."""
    if model._hfpaged.long_rope.crossing != "drop":
        return prompts, expected
    with pytest.raises(ValueError, match="computes each new token without context"):
        model.generate_many(prompts, **SETTINGS)
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]
    keep = [i for i, p in enumerate(prompts) if len(p) > L or len(p) + SETTINGS["max_new_tokens"] <= L + 1]
    return [prompts[i] for i in keep], [expected[i] for i in keep]


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_longrope_models_are_exact_across_the_original_length(arch, backend):
    model = longrope_model(arch)
    prompts = random_prompts(LENGTHS, seed=1)
    expected = expected_tokens(model, prompts)
    # chunked prompts (8 tokens a step), packed steps of short and long sequences, recompute preemption
    hfpaged.patch(model, num_blocks=12, block_size=4, max_num_batched_tokens=8, attention_backend=backend)
    state = model._hfpaged
    assert state.length_limit is None and state.long_rope.original == L
    assert state.long_rope.crossing == CROSSING[arch]
    prompts, expected = served(model, prompts, expected)
    assert [r.token_ids for r in model.generate_many(prompts, **SETTINGS)] == expected
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("arch", list(MODELS))
def test_longrope_under_swap_callers_prefix_hits_and_changed_weights(arch):
    model = longrope_model(arch)
    prompts = random_prompts(LENGTHS, seed=2)
    expected = expected_tokens(model, prompts)
    hfpaged.patch(model, num_blocks=14, block_size=4, preemption_mode="swap", swap_space=0.01)
    prompts, expected = served(model, prompts, expected)
    assert [r.token_ids for r in model.generate_many(prompts, **SETTINGS)] == expected
    assert hfpaged.stats(model)["num_swapped_out"] > 0
    check_callers_and_changed_weights(model, prompts, expected, **SETTINGS)


@pytest.mark.parametrize("arch", list(MODELS))
def test_prefix_blocks_are_shared_only_between_requests_rotated_alike(arch):
    # a short prompt's blocks hold short keys; a long prompt with the same first 12 tokens is long at every
    # position (and, for Phi-3, so is the short one once it grows past L): hits only where the keys agree
    model = longrope_model(arch)
    short, tail = random_prompts([12, 8], seed=3)
    long = short + tail  # 20 > L
    settings = dict(SETTINGS, max_new_tokens=3)  # the short prompt stays below L
    expected = reference_generate(model, [short, long], **settings)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    assert [r.token_ids for r in model.generate_many([short], **settings)] == expected[:1]
    before = hfpaged.stats(model)["prefix_cache_hits"]
    assert [r.token_ids for r in model.generate_many([long], **settings)] == expected[1:]
    assert hfpaged.stats(model)["prefix_cache_hits"] == before  # the short keys are not the long prompt's
    assert [r.token_ids for r in model.generate_many([long], **settings)] == expected[1:]
    assert hfpaged.stats(model)["prefix_cache_hits"] > before  # the long prompt's own blocks are
    assert [r.token_ids for r in model.generate_many([short], **settings)] == expected[:1]


def test_the_mark_reaching_anything_but_the_rotary_module_keeps_the_length_limit():
    model = longrope_model("llama")
    inner = model.model
    forward = inner.forward

    def with_absolute_positions(input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        # a decoder that also reads position_ids itself: marked positions would change what it computes
        embeds = inner.embed_tokens(input_ids) + 1e-3 * position_ids[..., None].float()
        return forward(inputs_embeds=embeds, position_ids=position_ids, **kwargs)

    inner.forward = with_absolute_positions
    hfpaged.patch(model, num_blocks=16, block_size=4)
    assert model._hfpaged.long_rope is None and model._hfpaged.length_limit[0] == L
    with pytest.raises(ValueError, match=f"past the {L} positions"):
        model.generate_many([[5] * 10], max_new_tokens=10)
    assert hfpaged.stats(model)["num_free_blocks"] == 16


def test_a_generate_that_cannot_be_told_apart_keeps_the_length_limit(monkeypatch):
    # a preparation that drops the cache even short of L: neither of the two known behaviours
    model = longrope_model("phi3")
    prepare = model.prepare_inputs_for_generation

    def always_drops(input_ids, past_key_values=None, **kwargs):
        return prepare(input_ids, None, **kwargs)

    monkeypatch.setattr(model, "prepare_inputs_for_generation", always_drops)
    hfpaged.patch(model, num_blocks=16, block_size=4)
    assert model._hfpaged.long_rope is None and model._hfpaged.length_limit[0] == L


def test_where_generate_computes_past_l_without_context_requests_reaching_that_are_refused(monkeypatch):
    # transformers 5.17-5.19's Phi-3 (the GPU machine's version): checked here on any version
    from hfpaged.model import hf_compat

    monkeypatch.setattr(hf_compat, "longrope_crossing", lambda model, original: "drop")
    model = longrope_model("phi3")
    prompts = random_prompts([5, 15, 17], seed=5)  # 5 + 12 = L + 1 tokens at most: never the dropping forward
    expected = reference_generate(model, prompts, **dict(SETTINGS, max_new_tokens=12))
    hfpaged.patch(model, num_blocks=16, block_size=4)
    assert model._hfpaged.long_rope.crossing == "drop" and model._hfpaged.length_limit is None
    with pytest.raises(ValueError, match=r"prompt 1 has 15 tokens and may grow to 27: .*without context"):
        model.generate_many(prompts, **dict(SETTINGS, max_new_tokens=12))
    assert hfpaged.stats(model)["num_free_blocks"] == 16
    results = model.generate_many(
        [dict(prompt=prompts[0], max_new_tokens=12), prompts[2]], **dict(SETTINGS, max_new_tokens=12)
    )
    assert [r.token_ids for r in results] == [expected[0], expected[2]]


def test_a_rope_buffer_replaced_under_inference_mode_leaves_the_model_usable():
    # transformers 5.17's longrope forward re-registers inv_freq; under torch.inference_mode (a stock generate of the
    # user's, or a forward past L) the new buffer is an inference tensor, which has no version counter
    model = longrope_model("llama")
    prompts = random_prompts([5, 20], seed=6)
    expected = expected_tokens(model, prompts)
    hfpaged.patch(model, num_blocks=16, block_size=4)
    rotary = model.model.rotary_emb
    with torch.inference_mode():
        rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), persistent=False)
    assert rotary.inv_freq.is_inference()
    assert [r.token_ids for r in model.generate_many(prompts, **SETTINGS)] == expected


@pytest.mark.parametrize("options", [dict(async_scheduling=False), dict(repetition_penalty=1.3)])
def test_a_lone_request_computed_again_past_l_without_a_step_in_flight(options):
    # Phi-3 ("recompute"; on transformers < 5.20 the same with use_cache=False): the restart step used to close
    # admission, so a lone request with no overlapped step stopped with "scheduler made no progress"
    model = longrope_model("phi3")
    prompt = random_prompts([14], seed=21)[0]
    patch_options = {k: v for k, v in options.items() if k == "async_scheduling"}
    settings = dict(SETTINGS, max_new_tokens=6, **{k: v for k, v in options.items() if k not in patch_options})
    if CROSSING["phi3"] == "drop":
        settings["use_cache"] = False  # every stock forward computes the whole sequence: long past L
    expected = reference_generate(model, [prompt], **settings)
    hfpaged.patch(model, num_blocks=16, block_size=4, **patch_options)
    assert [r.token_ids for r in model.generate_many([prompt], **settings)] == expected
    assert hfpaged.stats(model)["num_free_blocks"] == 16


@pytest.mark.parametrize("arch", list(MODELS))
def test_use_cache_false_computes_the_sequence_again_past_l_as_generate_does(arch):
    # stock generate(use_cache=False) runs every forward over the whole sequence: past L every key is long (Llama
    # keeps its short keys with the cache); hfpaged computes such a request again from its first token there
    model = longrope_model(arch)
    prompts = random_prompts([5, 10, 14, 20], seed=211)
    settings = dict(SETTINGS, max_new_tokens=10)
    expected = reference_generate(model, prompts, use_cache=False, **settings)
    if arch == "llama":
        assert expected != reference_generate(model, prompts, **settings)  # the setting matters here
    hfpaged.patch(model, num_blocks=14, block_size=4, max_num_batched_tokens=8)
    assert [r.token_ids for r in model.generate_many(prompts, use_cache=False, **settings)] == expected
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_a_prefill_chunk_size_shorter_than_a_long_prompt_is_refused():
    # stock's chunked prefill rotates its first chunks short (their own length is below L)
    model = longrope_model("llama")
    short, long = random_prompts([10, 20], seed=8)
    hfpaged.patch(model, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens .*prefill_chunk_size=8 with this longrope model"):
        model.generate_many([short, long], prefill_chunk_size=8, max_new_tokens=4)
    assert hfpaged.stats(model)["num_free_blocks"] == 16
    expected = reference_generate(model, [short, long], prefill_chunk_size=32, max_new_tokens=4, do_sample=False)
    got = model.generate_many([short, long], prefill_chunk_size=32, max_new_tokens=4, do_sample=False)
    assert [r.token_ids for r in got] == expected


def test_another_threads_stock_decoder_forward_keeps_its_own_rotation():
    # the per-token rotary forward serves this thread's paged steps only: a stock call of the decoder from another
    # thread (outside the model's forward lock) while steps run rotates its 30 tokens long, as stock does
    model = longrope_model("llama")
    x = torch.tensor([random_prompts([30], seed=152)[0]])
    with torch.no_grad():
        alone = model.model(x).last_hidden_state
    hfpaged.patch(model, num_blocks=40, block_size=4)
    stop, seen = threading.Event(), []

    def stock_calls():
        while not stop.is_set():
            with torch.no_grad():
                seen.append(torch.equal(model.model(x).last_hidden_state, alone))

    thread = threading.Thread(target=stock_calls)
    thread.start()
    try:
        for _ in range(3):
            model.generate_many(random_prompts([10, 20, 30], seed=1), max_new_tokens=10, do_sample=False)
    finally:
        stop.set()
        thread.join()
    assert seen and all(seen)


def test_tokens_are_marked_long_where_stock_generate_rotates_them_long():
    positions = np.array([0, 15, 16, 40, 3, 20])
    salted = np.array([False, False, False, False, True, True])  # the last two: requests long at every position
    marked = long_positions(positions, salted, L)
    assert marked.tolist() == [0, 15, 16 + LONG_POSITION, 40 + LONG_POSITION, 3 + LONG_POSITION, 20 + LONG_POSITION]
    assert marked.astype(np.int32).tolist() == marked.tolist()  # the step's int32 inputs hold marked positions
    assert LONG_POSITION > 2**20 * 64  # far past any position a pool holds


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(MODELS))
def test_longrope_models_are_exact_on_cuda_with_default_options(arch):
    model = longrope_model(arch).cuda()
    prompts = random_prompts(LENGTHS, seed=1)
    expected = expected_tokens(model, prompts)
    hfpaged.patch(model, num_blocks=12, block_size=4, max_num_batched_tokens=8)
    assert model._hfpaged.long_rope.crossing == CROSSING[arch]
    prompts, expected = served(model, prompts, expected)
    assert [r.token_ids for r in model.generate_many(prompts, **SETTINGS)] == expected
    runner = model._hfpaged.engine.runner
    assert model._hfpaged.use_triton and runner.num_graph_steps > 0
    assert generate_in_threads(model, prompts, **SETTINGS) == [expected[i::3] for i in range(3)]
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.gpu
def test_a_longrope_pool_sized_by_a_profile_forward_past_l_on_cuda():
    # the profile forward (max_num_batched_tokens tokens at positions up to the model's length) runs the rotary
    # modules as steps do: their stock forward, whose frequency switch re-registered inv_freq as an inference tensor
    # on transformers 5.17 (patch then failed reading its version), does not run there
    model = longrope_model("llama").cuda()
    prompts = random_prompts(LENGTHS, seed=1)
    expected = expected_tokens(model, prompts)
    hfpaged.patch(model, gpu_memory_utilization=0.3, max_num_batched_tokens=256)
    assert not model.model.rotary_emb.inv_freq.is_inference()
    assert [r.token_ids for r in model.generate_many(prompts, **SETTINGS)] == expected
    assert model._hfpaged.engine.runner.num_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(MODELS))
def test_requests_computed_again_past_l_on_cuda_with_default_options(arch):
    # the restart path in CUDA graphs: generate(use_cache=False) recomputes past L on every transformers version
    model = longrope_model(arch).cuda()
    prompts = random_prompts([5, 10, 14, 20], seed=211)
    settings = dict(SETTINGS, max_new_tokens=10, use_cache=False)
    expected = reference_generate(model, prompts, **settings)
    hfpaged.patch(model, num_blocks=14, block_size=4, max_num_batched_tokens=8)
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == expected
    assert model._hfpaged.engine.runner.num_graph_steps > 0
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
