"""Models whose attention or positions the paged forward would get wrong: refused at ``patch``, or served only
up to the length where they stop being exact (notes/model_support.md).

Each refused or limited case here was accepted before the check that now catches it and generated wrong tokens
(and inputs that change nothing must not refuse a model). A refusal must leave the model as it was; a refused
request must leave the pool all free.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from models import TINY_TEXT, generate_in_threads, make_model, random_prompts, reference_generate
from transformers import AutoModelForCausalLM

import hfpaged
from hfpaged.model.attention import UnsupportedModelError, check_attention_call

SMALL = dict(TINY_TEXT, max_position_embeddings=256, initializer_range=0.3)

CASES = {
    # chunked attention exists only in the mask the model builds
    "llama4": (
        "Llama4TextConfig",
        dict(intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=8, no_rope_layers=[1, 0]),
        "chunked_attention",
    ),
    # bidirectional attention: the module's is_causal is False
    "gemma_bidirectional": (
        "GemmaConfig",
        dict(use_bidirectional_attention=True),
        r"non-causal attention \(is_causal=False\)",
    ),
    # linear-attention layers keep a recurrent state outside any KV cache
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            layer_types=["linear_attention", "full_attention"],
            num_experts=2,
            num_experts_per_tok=1,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        ),
        "linear_attention",
    ),
    # BART-style decoders number positions from their cache and ignore the position_ids they are given
    "bart": (
        "BartConfig",
        dict(d_model=64, decoder_layers=2, encoder_layers=1, decoder_attention_heads=4, encoder_attention_heads=4)
        | dict(decoder_ffn_dim=64, encoder_ffn_dim=64, init_std=0.25),
        "ignores the position_ids it is given",
    ),
    # no layer rotates its queries and keys (SmolLM3 with every layer NoPE): told apart from a self-numbering decoder
    "all_nope": ("SmolLM3Config", dict(no_rope_layers=[0, 0], pad_token_id=0), "encodes no position in its queries"),
    # StableLM's decoder layers do not pass the forward's keyword arguments (hfpaged's step context) down
    "stablelm": ("StableLmConfig", {}, "StableLmAttention was called without hfpaged's step context"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_hfpaged_cannot_compute_is_refused_and_the_model_stays_as_it_was(case):
    config_name, overrides, reason = CASES[case]
    config = getattr(transformers, config_name)(**{**SMALL, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 96, (1, 20))
    before = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=reason) as refused:
        hfpaged.patch(model, num_blocks=32)
    assert type(model).__name__ in str(refused.value)
    assert not hasattr(model, "generate_many") and not hasattr(model, "_hfpaged")
    assert model.config._attn_implementation == implementation
    after = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(before, after)


def test_a_model_with_one_layer_dropping_the_step_context_is_refused():
    # before: patched, and that layer ran its stock attention without a cache inside paged steps (wrong tokens)
    config = transformers.LlamaConfig(**SMALL)
    model = AutoModelForCausalLM.from_config(config).eval()
    attention = model.model.layers[1].self_attn
    forward = attention.forward

    def forward_without_kwargs(*args, **kwargs):
        kwargs.pop("hfpaged", None)
        return forward(*args, **kwargs)

    attention.forward = forward_without_kwargs
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM: attention module LlamaAttention was called"):
        hfpaged.patch(model, num_blocks=16)
    del attention.forward
    hfpaged.patch(model, num_blocks=16)  # the same model with the layer's own forward back
    assert hfpaged.stats(model)["num_layers"] == 2


def test_a_model_whose_generate_numbers_positions_itself_is_refused_unless_it_counts_from_zero():
    # generate passes no position_ids to a model whose prepare_inputs_for_generation drops them (Kosmos-2.5): it
    # numbers tokens itself, RoBERTa-style from padding_idx + 1; before, hfpaged passed 0-based ones (wrong tokens)
    from transformers import RobertaConfig, RobertaForCausalLM

    class DropsPositions(RobertaForCausalLM):
        def prepare_inputs_for_generation(self, *args, **kwargs):
            inputs = super().prepare_inputs_for_generation(*args, **kwargs)
            inputs.pop("position_ids", None)
            return inputs

    config = RobertaConfig(**{**SMALL, "is_decoder": True, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2})
    model = DropsPositions(config).eval()
    with pytest.raises(UnsupportedModelError, match="DropsPositions numbers positions itself in generate"):
        hfpaged.patch(model, num_blocks=16)
    plain = RobertaForCausalLM(config).eval()  # generate passes it 0-based position_ids, as hfpaged does
    ids = torch.randint(3, 96, (1, 9))
    expected = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    hfpaged.patch(plain, num_blocks=16)
    assert plain.generate_many([ids[0].tolist()], max_new_tokens=10)[0].token_ids == expected[0, 9:].tolist()


def test_neutral_inputs_and_a_vision_towers_layer_types_do_not_refuse_a_model():
    # LLaVA-OneVision hands logits_to_keep down to attention; a vision config's layer_types never run in text
    module = torch.nn.Module()
    check_attention_call(module, None, dict(logits_to_keep=0), 4)
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**SMALL),
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=16,
        ),
    )
    config.vision_config.layer_types = ["window_attention"]
    model = transformers.LlavaForConditionalGeneration(config).eval()
    hfpaged.patch(model, num_blocks=16)
    assert hfpaged.stats(model)["num_layers"] == 2


def test_an_attention_call_is_checked_for_extra_inputs_non_causal_modules_and_masks():
    module = torch.nn.Module()
    neutral = dict(hfpaged=object(), position_ids=torch.arange(3), use_cache=False, is_causal=True, sinks=None)
    check_attention_call(module, None, neutral, 4)  # nothing the kernels would ignore
    check_attention_call(module, None, dict(hfpaged_block_tables=torch.zeros(1)), 4)  # the compiled path's inputs
    check_attention_call(module, None, dict(s_aux=torch.zeros(4)), 4)  # attention sinks: one logit per query head
    with pytest.raises(UnsupportedModelError, match="passes position_bias to its attention function"):
        check_attention_call(module, None, dict(s_aux=torch.zeros(4), position_bias=torch.zeros(1)), 4)
    bad = {
        r"of shape \(2,\) and dtype float32": torch.zeros(2),
        r"of shape \(4, 1\) and dtype float32": torch.zeros(4, 1),
        r"of shape \(4,\) and dtype int64": torch.zeros(4, dtype=torch.int64),
        r"of shape \(4,\) and dtype float8_e4m3fn": torch.zeros(4).to(torch.float8_e4m3fn),  # the kernels take none
        "as a list": [0.0] * 4,
    }
    for what, sinks in bad.items():
        with pytest.raises(UnsupportedModelError, match=rf"attention sinks \(s_aux\) {what}; .*\(4 here\)"):
            check_attention_call(module, None, dict(s_aux=sinks), 4)
    assert hfpaged.UnsupportedModelError is UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="non-causal"):
        check_attention_call(module, None, dict(is_causal=False), 4)
    module.is_causal = False
    with pytest.raises(UnsupportedModelError, match="non-causal"):
        check_attention_call(module, None, {}, 4)
    module.is_causal = True
    with pytest.raises(UnsupportedModelError, match="mask its model builds itself"):
        check_attention_call(module, torch.zeros(1, 1, 3, 3), {}, 4)


LIMITED = {
    # NTK-rescaled frequencies once a forward's longest sequence passes max_position_embeddings
    "dynamic": (
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), max_position_embeddings=16),
        "'dynamic' RoPE keeps one set of frequencies",
    ),
    # the window is in the mask PhiMoE builds (and in stock's cache), never in the attention call
    "phimoe_window": (
        "PhimoeConfig",
        dict(sliding_window=16, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=64),
        "layer 0's sliding window, which transformers' cache keeps but the layer's attention call does not pass",
    ),
}


@pytest.mark.parametrize("case", list(LIMITED))
def test_a_model_exact_only_up_to_a_length_is_served_up_to_it_and_refuses_requests_past_it(case):
    config_name, overrides, why = LIMITED[case]
    config = getattr(transformers, config_name)(**{**SMALL, **overrides, "eos_token_id": None})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    budgets = [17 - len(p) for p in prompts]  # every sequence forwards 16 positions at most (17 tokens)
    expected = [
        model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist()
        for p, n in zip(prompts, budgets)
    ]
    hfpaged.patch(model, num_blocks=32, block_size=4, max_num_batched_tokens=8)  # chunked prompts, packed steps
    assert model._hfpaged.length_limit[0] == 16
    got = model.generate_many([dict(prompt=p, max_new_tokens=n) for p, n in zip(prompts, budgets)], do_sample=False)
    assert [r.token_ids for r in got] == expected
    # one position further, the packed step could differ from stock's one-sequence forwards
    with pytest.raises(
        ValueError, match=rf"prompt 1 may grow to 18 tokens \(17 forwarded\), past the 16 positions .*{re.escape(why)}"
    ):
        model.generate_many([prompts[0], prompts[2]], max_new_tokens=4, do_sample=False)
    assert hfpaged.stats(model)["num_free_blocks"] == 32
    assert [r.token_ids for r in model.generate_many(prompts[:1], max_new_tokens=budgets[0])] == expected[:1]
    # within the limit, swap preemption and three callers at once change nothing
    hfpaged.unpatch(model)
    hfpaged.patch(model, num_blocks=6, block_size=4, preemption_mode="swap", swap_space=0.01)
    requests = [dict(prompt=p, max_new_tokens=n) for p, n in zip(prompts, budgets)] * 2
    assert generate_in_threads(model, requests, do_sample=False) == [[e, e] for e in expected]
    assert hfpaged.stats(model)["num_preemptions"] > 0


def test_heads_wider_than_the_triton_kernels_take_run_the_torch_attention(monkeypatch):
    # before: "auto" picked the Triton kernels on CUDA for any head size, and every step failed on their check
    config = transformers.LlamaConfig(**{**SMALL, "head_dim": 288})
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 96, (1, 7))
    before = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    with pytest.raises(ValueError, match="attention layer 0 has query/key heads of 288 and value heads of 288; the Tr"):
        hfpaged.patch(model, num_blocks=16, attention_backend="triton")
    assert not hasattr(model, "_hfpaged")
    hfpaged.patch(model, num_blocks=16)
    assert model.generate_many([ids[0].tolist()], max_new_tokens=6)[0].token_ids == before[0, 7:].tolist()
    narrow = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**SMALL, "head_dim": 256})).eval()
    hfpaged.patch(narrow, num_blocks=16)
    monkeypatch.setattr(type(model._hfpaged), "uses_cuda", property(lambda self: True))  # as on a GPU
    assert not model._hfpaged.use_triton and narrow._hfpaged.use_triton


def test_an_attention_function_registered_outside_transformers_is_refused():
    """A function registered with ``AttentionInterface.register`` and selected before or after ``patch`` was
    silently replaced by the paged kernels' standard attention (a probe); it is refused, at patch or per call."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def halved_sdpa(module, query, key, value, mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
        return out * 0.5, weights

    AttentionInterface.register("halved_sdpa_test", halved_sdpa)
    prompts = random_prompts([5, 9], seed=3)
    model = make_model("llama")
    model.set_attn_implementation("halved_sdpa_test")
    with pytest.raises(ValueError, match="'halved_sdpa_test' is a function registered outside transformers"):
        hfpaged.patch(model, num_blocks=32, block_size=4)
    model.set_attn_implementation("sdpa")
    hfpaged.patch(model, num_blocks=32, block_size=4)
    model.set_attn_implementation("halved_sdpa_test")
    with pytest.raises(ValueError, match="registered outside transformers"):
        model.generate_many(prompts, max_new_tokens=4)
    model.set_attn_implementation("eager")
    got = model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    assert [r.token_ids for r in got] == reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_transformers_paged_attention_implementations_are_refused(tmp_path):
    """``attn_implementation="paged|eager"`` (transformers' own paged attention, for ``generate_batch``) does not
    attend causally in a plain forward, as stock generate runs it: hfpaged's causal attention gave other tokens than
    that model's stock generate (a probe). Refused at patch, and per call when selected after patch."""
    make_model("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="paged|eager").eval()
    with pytest.raises(ValueError, match="'paged\\|eager' is transformers' own paged attention"):
        hfpaged.patch(model, num_blocks=32, block_size=4)
    model.set_attn_implementation("eager")
    hfpaged.patch(model, num_blocks=32, block_size=4)
    model.set_attn_implementation("paged|eager")
    prompts = random_prompts([7], seed=4)
    with pytest.raises(ValueError, match="paged attention"):
        model.generate_many(prompts, max_new_tokens=4)
    model.set_attn_implementation("sdpa")
    got = model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    assert [r.token_ids for r in got] == reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_a_dynamically_quantized_model_is_refused():
    """``quantize_dynamic`` scales each Linear's input per call, over the whole packed step: a probe found prompts'
    tokens depending on their batch neighbours. Refused at patch; the model stays usable."""
    model = torch.ao.quantization.quantize_dynamic(make_model("llama"), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(UnsupportedModelError, match="dynamically quantized Linear"):
        hfpaged.patch(model, num_blocks=32, block_size=4)
    assert not hasattr(model, "_hfpaged")
    ids = torch.tensor([random_prompts([6], seed=2)[0]])
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False).shape == (1, 9)
