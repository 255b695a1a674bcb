"""Tiny random-weight models of every supported architecture, built from config (no downloads)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

VOCAB = 96
MAX_POS = 512

# name -> (config class name, kwargs). initializer_range is raised so greedy continuations vary
# (at default init tiny models repeat one token forever); Gemma2 stays varied only near 0.02.
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)),
    "mistral": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8, initializer_range=0.3),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            initializer_range=0.3,
        ),
    ),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16, initializer_range=0.3)),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            initializer_range=0.02,
        ),
    ),
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, initializer_range=0.3)),
    "gpt2": ("GPT2Config", dict(n_head=4, n_embd=64, n_layer=2, n_positions=MAX_POS, initializer_range=0.3)),
    "opt": ("OPTConfig", dict(num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64, init_std=0.3)),
    "gpt_neox": ("GPTNeoXConfig", dict(num_attention_heads=4, initializer_range=0.3)),
}
# GPT-J's attention runs through transformers' attention interface from transformers 5.24 on (earlier versions
# compute it in the class, and patch refuses the model: tests/test_api.py)
GPTJ_CONFIG = dict(n_head=4, n_embd=64, n_layer=2, n_positions=MAX_POS, rotary_dim=8, initializer_range=0.3)


def uses_attention_interface(model_type: str) -> bool:
    """Whether transformers' modeling code of ``model_type`` calls the attention interface."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)


if uses_attention_interface("gptj"):
    ARCHS["gptj"] = ("GPTJConfig", GPTJ_CONFIG)


def make_config(arch: str, **overrides):
    import transformers

    cls_name, kwargs = ARCHS[arch]
    cls = getattr(transformers, cls_name)
    base = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    if arch not in ("gpt2", "gptj"):
        base.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=MAX_POS)
    base.update(kwargs)
    base.update(overrides)
    return cls(**base)


def make_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_prompts(lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def reference_generate(model, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    """Stock ``model.generate`` run on each prompt alone: the generated ids."""
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p], device=model.device), **kwargs)
            out.append(seq[0, len(p) :].tolist())
    return out


def generate_in_threads(model, prompts: list[list[int]], callers: int = 3, timeout: float = 600, **kwargs):
    """``generate_many`` from ``callers`` threads at once, caller i on ``prompts[i::callers]``: each caller's token
    ids, in caller order."""
    import threading

    results = [None] * callers

    def caller(i):
        results[i] = [r.token_ids for r in model.generate_many(prompts[i::callers], **kwargs)]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results


def check_callers_and_changed_weights(model, prompts: list[list[int]], expected: list[list[int]], **settings) -> None:
    """On a patched ``model`` whose greedy ``expected`` tokens for ``prompts`` are stock's: three callers at once
    get them, then an in-place weight change is seen by the next call (stock's new tokens), and the pool ends free."""
    import hfpaged

    assert generate_in_threads(model, [dict(prompt=p, **settings) for p in prompts]) == [
        expected[i::3] for i in range(3)
    ]
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.mul_(-1.5)
    changed = reference_generate(model, prompts, **settings)
    assert changed != expected
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == changed
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


# More architectures, token-exact in tests/test_architectures.py: each brings something the ones above do not
# (parallel attention/MLP, q/k norms, muP multipliers, NoPE layers, MoE routing, MLA's narrower V heads,
# multi-query attention, partial rotary, interleaved sliding/full layers).
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
MORE_ARCHS: dict[str, dict] = {
    "cohere": dict(use_qk_norm=True),
    "cohere2": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "olmo2": {},
    "olmo3": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    "starcoder2": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], initializer_range=0.02),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "qwen3_moe": MOE,
    "olmoe": MOE,
    "deepseek_v3": dict(
        head_dim=8,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
    "exaone4": dict(sliding_window=8, sliding_window_pattern=2),
    "glm4": {},
    "phi": dict(partial_rotary_factor=0.5),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, multi_query=True, n_positions=MAX_POS),
    "seed_oss": {},
    "ernie4_5": {},
    "helium": {},
    # attention sinks (s_aux): GPT-OSS (MoE, alternating windows), Granite-SWA (its MoE too), MiMo-V2-Flash (sinks in
    # its sliding layers only, which have twice the KV heads)
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "granite_swa": dict(sliding_window=8),
    "granitemoe_swa": dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2),
    "mimo_v2_flash": dict(sliding_window=8),
}


def _has_model_type(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


if _has_model_type("flint"):  # transformers 5.24 on: sinks, and rotary sliding layers beside NoPE full layers
    MORE_ARCHS["flint"] = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])


# The text part of a tiny config, for config classes built by name (tests/test_model_support.py too).
TINY_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
TINY_TEXT.update(num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS)
# frequencies switch to long_factor once a forward's longest sequence passes 16 positions
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)
LONGROPE.update(short_factor=[1.0] * 8, long_factor=[3.0] * 8)


def make_more_model(arch: str, seed: int = 0, **overrides):
    """A tiny random-weight model of one of ``MORE_ARCHS`` (float32), its config settings updated by ``overrides``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = dict(TINY_TEXT, initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[arch](**{**base, **MORE_ARCHS[arch], **overrides})
    return AutoModelForCausalLM.from_config(config).eval()
