"""patch / unpatch / Engine API, bad input, and recovery after failures."""

import numpy as np
import pytest
import torch
import transformers
from models import GPTJ_CONFIG, VOCAB, make_model, random_prompts, reference_generate, uses_attention_interface
from transformers import AutoModelForCausalLM, GenerationConfig

import hfpaged
from hfpaged.model.attention import ATTENTION_NAME, UnsupportedModelError


@pytest.fixture
def model():
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    return m


def all_free(m):
    st = hfpaged.stats(m)
    return st["num_free_blocks"] == st["num_blocks"]


# --- patch / unpatch -----------------------------------------------------------------------------


def test_stock_forward_and_generate_unchanged_after_patch_and_unpatch():
    m = make_model("mistral")
    prompts = random_prompts([5, 12], seed=2)
    batch = torch.tensor([[0] * 7 + prompts[0], prompts[1]])  # left padding
    mask = torch.tensor([[0] * 7 + [1] * 5, [1] * 12])
    with torch.no_grad():
        logits_before = m(batch, attention_mask=mask).logits
    gen_before = m.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    attn_before = m.config._attn_implementation

    hfpaged.patch(m, num_blocks=32, block_size=4)
    m.generate_many(prompts, max_new_tokens=4)
    assert m.config._attn_implementation == attn_before
    with torch.no_grad():
        assert torch.equal(m(batch, attention_mask=mask).logits, logits_before)
    assert torch.equal(m.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False), gen_before)

    hfpaged.unpatch(m)
    assert not hasattr(m, "generate_many") and not hasattr(m, "_hfpaged")
    assert not any("_hfpaged_kv" in mod.__dict__ for mod in m.modules())
    assert m.config._attn_implementation == attn_before
    assert torch.equal(m.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False), gen_before)
    with pytest.raises(ValueError, match="not patched"):
        hfpaged.stats(m)


def test_patching_twice_is_safe_and_new_settings_repatch(model):
    state = model._hfpaged
    assert hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32) is model
    assert model._hfpaged is state
    hfpaged.patch(model, num_blocks=20, block_size=8)
    assert hfpaged.stats(model)["num_blocks"] == 20 and hfpaged.stats(model)["block_size"] == 8
    prompts = random_prompts([6, 9], seed=3)
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6, do_sample=False)] == (
        reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    )


def test_one_pool_shared_by_all_layers_with_exact_num_blocks(model):
    state = model._hfpaged
    assert len(state.kv_caches) == model.config.num_hidden_layers
    for k, v in state.kv_caches:
        assert k.shape == (40, 4, 2, 16) and v.shape == (40, 4, 2, 16)
    assert hfpaged.stats(model)["num_blocks"] == 40


def test_default_pool_size_on_cpu_is_bounded():
    m = make_model("llama")
    hfpaged.patch(m, max_num_seqs=2)
    st = hfpaged.stats(m)
    assert st["num_blocks"] == 2 * (512 // 16)  # max_num_seqs x blocks for max_position_embeddings


@pytest.mark.parametrize(
    "name,cfg",
    [
        ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB)),
        ("GPTJConfig", dict(GPTJ_CONFIG, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)),
        ("BloomConfig", dict(hidden_size=64, n_head=4, n_layer=2, vocab_size=VOCAB)),
    ],
)
def test_models_outside_the_attention_interface_are_refused(name, cfg):
    m = AutoModelForCausalLM.from_config(getattr(transformers, name)(**cfg)).eval()
    cls = type(m).__name__
    if name == "GPTJConfig" and uses_attention_interface("gptj"):
        # transformers 5.24 moved GPT-J onto the interface: it patches, and test_parity checks its tokens
        hfpaged.patch(m, num_blocks=8)
        assert hfpaged.stats(m)["num_layers"] == 2 and hasattr(m, "generate_many")
        return
    with pytest.raises(TypeError, match=cls):
        hfpaged.patch(m, num_blocks=8)
    assert not hasattr(m, "generate_many")


def test_non_causal_models_are_refused():
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=32, vocab_size=50, d_kv=16)
    )
    with pytest.raises(ValueError, match="T5ForConditionalGeneration is an encoder-decoder"):
        hfpaged.patch(t5)
    with pytest.raises(TypeError, match="PreTrainedModel, got Linear"):
        hfpaged.patch(torch.nn.Linear(2, 2))
    base = transformers.LlamaModel(make_model("llama").config)
    with pytest.raises(TypeError, match="LlamaModel"):
        hfpaged.patch(base)


def test_unknown_patch_option_and_bad_config_values():
    m = make_model("llama")
    with pytest.raises(TypeError, match="unknown options"):
        hfpaged.patch(m, blok_size=4)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        hfpaged.patch(m, block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        hfpaged.patch(m, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'yes'"):
        hfpaged.patch(m, enable_prefix_caching="yes")
    for name, value in (("swap_space", "4"), ("watermark", float("nan")), ("cpu_kv_cache_gib", float("inf"))):
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got {value!r}"):
            hfpaged.patch(m, **{name: value})
    assert not hasattr(m, "_hfpaged")


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=0),
        dict(attention_backend="triton"),
        dict(gemv=True),
        dict(dependent_launch=True),
        dict(kv_cache_dtype="fp8", kv_cache_scales=[(0.1, 0.1)] * 3),  # 3 pairs for 2 layers (checked in attach)
        dict(swap_space=float("inf"), preemption_mode="swap"),  # (session 39: nan/inf were converted in attach,
        dict(cpu_kv_cache_gib=float("nan"), num_blocks=None),  # after the old patch was taken off)
        dict(cpu_kv_cache_gib=float("inf"), num_blocks=None),
        dict(gpu_memory_utilization="0.5"),  # (a bare TypeError)
    ],
)
def test_a_refused_repatch_leaves_the_working_patch_and_its_requests(model, monkeypatch, options):
    # the device checks (Triton kernels on a CPU model) ran after the old patch was taken off: the model was left
    # unpatched and what ran on it aborted; block_size=0 (refused by EngineConfig) is the control
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    prompts = random_prompts([6, 9], seed=4)
    before = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6)]
    with pytest.raises(ValueError) as fresh:
        hfpaged.patch(make_model("llama"), **options)
    engine = hfpaged.Engine(model)
    engine.add_request(prompts[0], request_id="running", max_new_tokens=6, do_sample=False)
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    state = model._hfpaged
    with pytest.raises(ValueError) as refused:
        hfpaged.patch(model, **options)
    assert str(refused.value) == str(fresh.value)  # the same refusal as on an unpatched model
    assert model._hfpaged is state and hfpaged.stats(model)["num_blocks"] == 40
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == before[0]
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6)] == before
    assert all_free(model)


def test_patch_and_unpatch_of_a_torch_compile_wrapper_ask_for_the_model_itself(model):
    # unpatch(torch.compile(model)) dropped the engine state but left generate_many and the forward wrapper on the
    # model inside; patch of the wrapper was refused (and one with other settings half-unpatched the model first)
    compiled = torch.compile(model)
    prompts = random_prompts([6, 9], seed=5)
    before = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=5)]
    wrapper = r"got OptimizedModule \(torch.compile's wrapper of LlamaForCausalLM\): pass the model itself"
    for call in (hfpaged.unpatch, hfpaged.patch, lambda m: hfpaged.patch(m, num_blocks=20, block_size=8)):
        with pytest.raises(TypeError, match=wrapper):
            call(compiled)
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=5)] == before  # still fully patched
    assert all_free(model)
    assert hfpaged.unpatch(compiled._orig_mod) is model
    assert not hasattr(model, "_hfpaged") and "forward" not in model.__dict__
    assert not any(hasattr(model, name) for name in ("generate_many", "stream_many", "astream_many"))


def test_a_forward_that_raises_in_the_probe_is_reported_without_blaming_the_attention():
    m = make_model("llama")

    def hook(module, args, output):
        raise RuntimeError("my hook failed")

    handle = m.model.layers[1].mlp.register_forward_hook(hook)
    message = r"LlamaForCausalLM's forward raised RuntimeError: my hook failed during hfpaged's probe forward"
    with pytest.raises(UnsupportedModelError, match=message) as info:
        hfpaged.patch(m, num_blocks=8)
    assert "AttentionInterface" not in str(info.value) and "not reachable" not in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not hasattr(m, "_hfpaged")
    handle.remove()
    hfpaged.patch(m, num_blocks=8)
    prompts = random_prompts([7], seed=6)
    assert [r.token_ids for r in m.generate_many(prompts, max_new_tokens=4, do_sample=False)] == (
        reference_generate(m, prompts, max_new_tokens=4, do_sample=False)
    )


@pytest.mark.parametrize("how", ["cpu_offload", "meta embeddings"])
def test_input_embeddings_on_the_meta_device_are_refused_at_patch(model, how):
    # accelerate's whole-model offload keeps the weights on the meta device: patch blamed the attention interface
    m = make_model("llama")
    if how == "cpu_offload":
        pytest.importorskip("accelerate").cpu_offload(m, execution_device=torch.device("cpu"))
    else:
        weight = m.model.embed_tokens.weight
        m.model.embed_tokens.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"))
    message = r"parameter 'model.embed_tokens.weight' is on the meta device .* load the model without offloading"
    with pytest.raises(ValueError, match=message):
        hfpaged.patch(m, num_blocks=8)
    assert not hasattr(m, "_hfpaged") and not hasattr(m, "generate_many")
    state = model._hfpaged  # a patched model offloaded since keeps its patch when patched again
    weight = model.model.embed_tokens.weight
    model.model.embed_tokens.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"))
    with pytest.raises(ValueError, match=message):
        hfpaged.patch(model, num_blocks=20)
    assert model._hfpaged is state


def test_layers_offloaded_to_disk_by_a_device_map_are_not_refused(tmp_path):
    # only the input embeddings must be materialized; a decoder layer on "disk" is loaded by its hook
    pytest.importorskip("accelerate")
    make_model("llama").save_pretrained(tmp_path / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    device_map.update({"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off")
    assert m.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    prompts = random_prompts([7, 11], seed=7)
    expected = reference_generate(m, prompts, max_new_tokens=5, do_sample=False)
    hfpaged.patch(m, num_blocks=16, block_size=4)
    assert [r.token_ids for r in m.generate_many(prompts, max_new_tokens=5, do_sample=False)] == expected


# --- generate_many inputs -------------------------------------------------------------------------


def test_empty_prompt_list_returns_empty(model):
    assert model.generate_many([]) == []


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([[5, 6], []], {}, "prompt 1 is empty"),
        ([[5], "hello"], {}, "prompt 1 is a string but no tokenizer"),
        ([[5, VOCAB + 3]], {}, rf"prompt 0 has token id {VOCAB + 3} outside the vocabulary \[0, {VOCAB}\)"),
        ([[5, -1]], {}, "prompt 0 has token id -1 outside"),
        ([[4], [5] * 600], {"max_new_tokens": 5}, r"prompt 1 needs up to 604 KV slots \(151 blocks of 4\)"),
        (
            [[4] * 10],
            {"max_new_tokens": 200},
            r"prompt 0 needs up to 209 KV slots \(53 blocks of 4\) but the pool holds only 40",
        ),
        ([[4]], {"do_sample": True, "temperature": -1.0}, "temperature must be a number > 0"),
        ([[4]], {"do_sample": True, "temperature": "hot"}, "temperature must be a number > 0 .* got 'hot'"),
        ([[4]], {"do_sample": True, "top_p": "x"}, r"top_p must be in \[0, 1\], got 'x'"),
        ([[4]], {"do_sample": True, "top_p": 1.5}, r"top_p must be in \[0, 1\]"),
        ([[4]], {"do_sample": True, "top_p": -0.1}, r"top_p must be in \[0, 1\]"),
        ([[4]], {"do_sample": True, "top_k": -2}, "top_k must be a non-negative int"),
        ([[4]], {"max_new_tokens": 0}, "max_new_tokens. must be"),
        ([[4]], {"penalty_alpha": 0.5, "top_k": 4}, "contrastive search"),
        ([[4]], {"use_mtp": True}, "use_mtp"),
        ([[4]], {"cache_implementation": "quantized"}, "cache_implementation='quantized'"),
        ([[4]], {"not_a_setting": 1}, "unsupported arguments"),
        ("hello", {}, "list of prompts"),
        (torch.tensor([[4, 5]]), {"attention_mask": torch.tensor([[1, 2]])}, r"must hold 0 \(padding\) and 1"),
        ([[4, 5.5]], {}, "prompt 0 must be a string or a list of int"),
        ([[4]], {"seed": "7"}, "seed must be an int, got '7'"),
        ([{"prompt": [4], "seed": 2**63}], {"do_sample": True}, "seed must be an int of 64 bits"),  # (session 39)
        ([[4]], {"max_new_tokens": float("inf")}, r"max_new_tokens must be a finite number > 0 \(tokens\), got inf"),
        ([[4]], {"max_new_tokens": float("nan")}, "max_new_tokens must be a finite number > 0"),
        ([[4]], {"max_length": float("inf")}, "max_length must be a finite number > 0"),
        ([[4]], {"max_time": "1"}, "max_time must be a number of seconds, got '1'"),
        ([[4]], {"max_time": [1]}, "max_time must be a number of seconds"),
        ([[4]], {"num_return_sequences": 0}, "num_return_sequences must be a positive int, got 0"),
        ([[4]], {"num_beams": 0}, "num_beams must be a positive int, got 0"),
        ([[4]], {"eos_token_id": ["</s>"]}, r"eos_token_id must be an int or a list of ints \(token ids\)"),
        ([[4]], {"pad_token_id": 1.5}, r"pad_token_id must be an int \(token ids\), got 1.5"),
    ],
)
def test_bad_input_raises_before_anything_runs(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate_many(prompts, **kwargs)
    assert all_free(model)
    prompts_ok = random_prompts([3, 8], seed=9)
    assert [r.token_ids for r in model.generate_many(prompts_ok, max_new_tokens=5, do_sample=False)] == (
        reference_generate(model, prompts_ok, max_new_tokens=5, do_sample=False)
    )


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_failure_mid_run_frees_every_block_and_the_next_call_is_exact(model, monkeypatch, exc_type):
    prompts = random_prompts([3, 17, 30, 8, 12], seed=11)
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    runner = hfpaged.Engine(model).runner
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(out, *args):
        calls["n"] += 1
        if calls["n"] == 6:
            raise exc_type("injected failure")
        return real_execute(out, *args)

    monkeypatch.setattr(runner, "execute", flaky)
    with pytest.raises(exc_type, match="injected failure"):
        model.generate_many(prompts, max_new_tokens=10, do_sample=False)
    assert all_free(model)
    assert model.config._attn_implementation != ATTENTION_NAME
    monkeypatch.setattr(runner, "execute", real_execute)
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=10, do_sample=False)] == expected
    assert all_free(model)


def test_failure_inside_the_model_forward_restores_attention(model, monkeypatch):
    layer = model.model.layers[1].mlp

    def boom(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(layer, "forward", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        model.generate_many(random_prompts([4, 5], seed=1), max_new_tokens=3)
    assert all_free(model)
    monkeypatch.undo()
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))  # ordinary forward works: attention is back to the original


# --- results and the Engine loop ------------------------------------------------------------------


def test_results_come_back_in_input_order_with_text_from_a_tokenizer(model):
    class CharTokenizer:
        def __call__(self, text):
            return {"input_ids": [3 + (ord(c) % 90) for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(48 + (i % 40)) for i in ids)

    tok = CharTokenizer()
    texts = ["hello there", "a", "what is the capital of France?"]
    results = model.generate_many(texts, tokenizer=tok, max_new_tokens=6, do_sample=False)
    expected = reference_generate(model, [tok(t)["input_ids"] for t in texts], max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert [r.prompt_token_ids for r in results] == [tok(t)["input_ids"] for t in texts]
    assert [r.text for r in results] == [tok.decode(e) for e in expected]
    # a tokenizer given to patch() is used when the call has none
    hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, tokenizer=tok)
    assert model.generate_many(texts[:1], max_new_tokens=6, do_sample=False)[0].text == tok.decode(expected[0])
    assert hfpaged.generate_many(model, texts[:1], max_new_tokens=6, do_sample=False)[0].token_ids == expected[0]


def test_generate_many_is_handed_finished_sequences_only_while_an_engine_handle_keeps_its_steps(model, monkeypatch):
    """Without a streamer or progress bar nothing reads generate_many's per-step outputs: the scheduler builds one
    output per sequence, when it finishes, with all its tokens. Requests of other callers on the same engine keep
    theirs, and so does generate_many with ``progress=True``."""
    from hfpaged.engine import Client

    seen = []
    step = Client.step

    def recording_step(self):
        outputs = step(self)
        seen.extend(outputs)
        return outputs

    monkeypatch.setattr(Client, "step", recording_step)
    prompts = random_prompts([5, 9, 14], seed=2)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    engine = hfpaged.Engine(model)
    other = engine.add_request(prompts[2], max_new_tokens=6, do_sample=False)
    results = model.generate_many(prompts[:2], max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == expected[:2]
    assert len(seen) == 2 and all(o.finished for o in seen)
    assert sorted((o.index, o.new_token_ids) for o in seen) == [(0, expected[0]), (1, expected[1])]
    seen.clear()
    while engine.has_unfinished():  # the handle's request ran in the same steps, one output per step
        engine.step()
    assert [o.request_id for o in seen] == [other] * 6 and [t for o in seen for t in o.new_token_ids] == expected[2]
    seen.clear()
    samples = model.generate_many(prompts[:2], max_new_tokens=4, do_sample=True, num_return_sequences=3, seed=1)
    assert len(seen) == 6 and all(o.finished and len(o.new_token_ids) == 4 for o in seen)
    by_sequence = {(o.index, o.sequence_index): o.new_token_ids for o in seen}
    assert by_sequence == {(i, j): s.token_ids for i, r in enumerate(samples) for j, s in enumerate(r.sequences)}
    seen.clear()
    model.generate_many(prompts[:1], max_new_tokens=4, do_sample=False, progress=True)
    assert len(seen) == 4 and [o.finished for o in seen] == [False, False, False, True]
    assert all_free(model)


def test_abort_drops_what_another_handles_step_delivered_for_the_prompt(model):
    # handle b's step runs the shared step and leaves a's output in a's outbox; a aborts before reading it
    a, b = hfpaged.Engine(model), hfpaged.Engine(model)
    victim = a.add_request(random_prompts([5], seed=14)[0], max_new_tokens=6, do_sample=False)
    kept = a.add_request(random_prompts([6], seed=15)[0], max_new_tokens=2, do_sample=False)
    b.add_request(random_prompts([3], seed=16)[0], max_new_tokens=6, do_sample=False)
    for _ in range(3):  # with async scheduling the first step's tokens come with the second
        if not a.outbox:
            b.step()
    assert {o.prompt_id for o in a.outbox} == {victim, kept}
    a.abort(victim)
    outputs = []
    while a.has_unfinished():
        outputs += a.step()
    assert outputs and {o.prompt_id for o in outputs} == {kept}
    while b.has_unfinished():
        b.step()
    assert all_free(model)


def test_engine_add_step_abort(model):
    engine = hfpaged.Engine(model)
    prompts = random_prompts([4, 9, 6], seed=12)
    expected = reference_generate(model, prompts, max_new_tokens=5, do_sample=False)
    ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
    ids.append(engine.add_request(random_prompts([7], seed=13)[0], request_id="victim", max_new_tokens=50))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], request_id="victim")
    gained = {i: [] for i in ids}
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id].extend(out.new_token_ids)
            assert out.token_ids == gained[out.request_id]
            if out.finished:
                finished[out.request_id] = out.finish_reason
        steps += 1
        if steps == 3:
            engine.abort("victim")
            assert "victim" not in engine.prompts
    assert [gained[i] for i in ids[:3]] == expected
    assert finished == {ids[0]: "length", ids[1]: "length", ids[2]: "length"}
    assert all_free(model)


def test_engine_add_requests_is_all_or_none(model):
    engine = hfpaged.Engine(model)
    prompts = random_prompts([4, 9, 6], seed=15)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with pytest.raises(ValueError, match="^prompt 2 has token id .* outside the vocabulary"):  # none is queued
        engine.add_requests([prompts[0], prompts[1], [VOCAB + 5]], [greedy] * 3, ["a", "b", "c"])
    with pytest.raises(ValueError, match="^prompt 1: temperature must be"):  # the errors name the prompt
        engine.add_requests(prompts[:2], [greedy, {"do_sample": True, "temperature": -1.0}])
    with pytest.raises(ValueError, match="^prompt 1: seed must be an int"):  # (raised after the settings merged)
        engine.add_requests(prompts[:2], [greedy, {**greedy, "seed": "x"}])
    with pytest.raises(ValueError, match="^prompt 1: seed must be an int of 64 bits"):  # (it broke every step)
        engine.add_requests(prompts[:2], [greedy, {"max_new_tokens": 4, "do_sample": True, "seed": 2**63}])
    with pytest.raises(ValueError, match="^prompt 1: max_time must be a number of seconds"):  # (it broke every step)
        engine.add_requests(prompts[:2], [greedy, {**greedy, "max_time": "1"}])
    config = GenerationConfig(max_new_tokens=2, do_sample=False)  # a settings dict's own config (session 39)
    (with_config,) = engine.add_requests(prompts[:1], [{"generation_config": config}])
    got = []
    while engine.has_unfinished():
        got += [t for out in engine.step() if out.request_id == with_config for t in out.new_token_ids]
    assert got == expected[0][:2]
    with pytest.raises(ValueError, match="^prompt 1: forced_bos_token_id=500 is outside"):  # named once
        engine.add_requests(prompts[:2], [greedy, {**greedy, "forced_bos_token_id": 500}])
    with pytest.raises(ValueError, match="^the prompt has token id"):  # add_request's one prompt: not numbered
        engine.add_request([VOCAB + 5], **greedy)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_requests(prompts[:2], [greedy] * 2, ["a", "a"])
    with pytest.raises(ValueError, match="one settings dict"):
        engine.add_requests(prompts, [greedy])
    with pytest.raises(ValueError, match="without '.'"):  # "x.1" is the name of the second sample of "x"
        engine.add_requests(prompts[:1], [greedy], ["x.1"])
    with pytest.raises(ValueError, match="without '.'"):
        engine.add_request(prompts[0], request_id=7, **greedy)
    assert not engine.has_unfinished() and all_free(model)
    ids = engine.add_requests(prompts, [greedy, {**greedy, "max_new_tokens": 2}, greedy], ["a", "b", None])
    assert ids[:2] == ["a", "b"]
    gained = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id].extend(out.new_token_ids)
    assert [gained[i] for i in ids] == [expected[0], expected[1][:2], expected[2]]
    assert all_free(model)


def test_engine_requests_are_batch_0_of_prefix_allowed_tokens_fn(model):
    # an Engine request has no place in a list: prefix_allowed_tokens_fn sees batch_id 0 for every one, whether
    # added alone or in an add_requests call (whose errors name the prompt by its place, and only its errors)
    prompts = random_prompts([4, 6, 5], seed=1)
    seen = set()

    def allowed(batch_id, input_ids):
        seen.add(batch_id)
        return [10 + batch_id, 20 + batch_id]

    settings = {"max_new_tokens": 4, "do_sample": False, "prefix_allowed_tokens_fn": allowed}
    expected = reference_generate(model, prompts, **settings)
    assert engine_tokens(model, lambda e: e.add_requests(prompts, [settings] * 3)) == expected
    assert engine_tokens(model, lambda e: [e.add_request(p, **settings) for p in prompts]) == expected
    assert seen == {0}
    assert all_free(model)


def engine_tokens(model, add) -> list[list[int]]:
    """The tokens each request of ``add(engine)`` (its ids) generates, run to the end on a new Engine handle."""
    engine = hfpaged.Engine(model)
    ids = add(engine)
    gained = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id].extend(out.new_token_ids)
    return [gained[i] for i in ids]


def test_engine_add_requests_sharing_settings_sample_like_add_request(model):
    """Prompts of one add_requests call with the same settings share one merged config; seeds stay their own."""
    prompt = random_prompts([8], seed=16)[0]
    settings = [dict(max_new_tokens=6, do_sample=True, top_k=8, seed=seed) for seed in (1, 2, 1)]
    together = engine_tokens(model, lambda e: e.add_requests([prompt] * 3, settings))
    alone = engine_tokens(model, lambda e: [e.add_request(prompt, **s) for s in settings])
    assert together == alone and together[0] == together[2] != together[1]
    assert all_free(model)


def test_sampling_runs_respects_top_k_and_is_reproducible_with_a_seed(model):
    prompts = random_prompts([3, 10, 6], seed=14)
    a = model.generate_many(prompts, max_new_tokens=12, do_sample=True, top_k=3, temperature=0.8, seed=7)
    b = model.generate_many(prompts, max_new_tokens=12, do_sample=True, top_k=3, temperature=0.8, seed=7)
    c = model.generate_many(prompts, max_new_tokens=12, do_sample=True, top_k=3, temperature=0.8, seed=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    # every sampled token is among the 3 most likely under the model at that point
    with torch.no_grad():
        for p, r in zip(prompts, a):
            ids = torch.tensor([p + r.token_ids])
            logits = model(ids).logits[0, len(p) - 1 : -1]
            top3 = logits.topk(3, dim=-1).indices
            assert all(t in top3[i].tolist() for i, t in enumerate(r.token_ids))
    assert all_free(model)


def test_a_tokenizers_batch_encoding_as_the_prompts_is_refused_clearly(model):
    # a BatchEncoding (tokenizer(...) or apply_chat_template(...) output) is a UserDict: iterating it gave its key
    # names, which generate_many then tokenized and generated from as two text prompts (a probe)
    from transformers import BatchEncoding

    encoding = BatchEncoding({"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3)})
    for call in (model.generate_many, model.stream_many):
        with pytest.raises(
            TypeError, match=r"BatchEncoding \(keys 'input_ids', 'attention_mask'\).*enc\['input_ids'\]"
        ):
            list(call(encoding, max_new_tokens=3))
    with pytest.raises(ValueError, match="not a single prompt"):
        model.generate_many({"prompt": [5, 6, 7]}, max_new_tokens=3)
    assert all_free(model)


def test_2d_numpy_batches_of_any_layout_are_taken_as_their_rows(model):
    # negative strides and big-endian dtypes failed inside torch.as_tensor for a 2-D batch (1-D prompts were taken)
    rows = np.array(random_prompts([6, 6], seed=7), dtype=np.int64)
    expected = [r.token_ids for r in model.generate_many([list(r) for r in rows], max_new_tokens=3, do_sample=False)]
    flipped_rows, flipped_columns = rows[::-1].copy()[::-1], rows[:, ::-1].copy()[:, ::-1]  # negative strides
    assert flipped_rows.strides[0] < 0 and flipped_columns.strides[1] < 0
    for batch in (flipped_rows, flipped_columns, rows.astype(">i8")):
        got = model.generate_many(batch, max_new_tokens=3, do_sample=False, attention_mask=np.ones_like(batch)[:, ::-1])
        assert [r.token_ids for r in got] == expected
    assert all_free(model)


def test_numpy_integers_for_beams_and_return_sequences_as_generate_takes_them(model):
    # (session 39) stock generate takes numpy integers here; generate_many refused them
    prompts = random_prompts([5, 8], seed=21)
    settings = dict(max_new_tokens=3, do_sample=False, num_beams=2, num_return_sequences=2)
    expected = [[s.token_ids for s in r.sequences] for r in model.generate_many(prompts, **settings)]
    numpy_settings = {**settings, "num_beams": np.int64(2), "num_return_sequences": np.int32(2)}
    got = [[s.token_ids for s in r.sequences] for r in model.generate_many(prompts, **numpy_settings)]
    assert got == expected and all(len(sequences) == 2 for sequences in got)
    assert all_free(model)


def test_torch_and_numpy_numbers_for_lengths_time_and_pool_options(model):
    # (session 39's review) stock generate takes 0-d tensors and numpy numbers for these; so does generate_many
    prompts = random_prompts([5, 8], seed=22)
    expected = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=3, do_sample=False)]
    for number in (torch.tensor(3), np.int64(3), np.array(3), torch.tensor(3, dtype=torch.uint8), np.uint8(3)):
        got = model.generate_many(prompts, max_new_tokens=number, max_time=torch.tensor(60.0), do_sample=False)
        assert [r.token_ids for r in got] == expected
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=None, cpu_kv_cache_gib=np.float32(0.01), watermark=torch.tensor(0.01))
    assert hfpaged.stats(m)["num_blocks"] > 0


def test_numpy_and_torch_numbers_for_sampling_settings(model):
    # (session 39's final review) stock generate takes them; temperature, top_p, top_k and the penalties were refused
    prompts = random_prompts([5, 8], seed=23)
    settings = dict(max_new_tokens=4, do_sample=True, seed=3, temperature=0.75, top_p=0.5, top_k=20, min_p=0.0)
    expected = [r.token_ids for r in model.generate_many(prompts, **settings, presence_penalty=0.5)]
    odd = dict(settings, temperature=np.float64(0.75), top_p=torch.tensor(0.5), top_k=np.int64(20), min_p=np.array(0.0))
    got = [r.token_ids for r in model.generate_many(prompts, **odd, presence_penalty=np.float32(0.5))]
    assert got == expected
    assert all_free(model)
