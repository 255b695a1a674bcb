"""Attention sinks (GPT-OSS's ``s_aux``): the kernels against the torch reference, the reference against the models'
own eager formula, and the argument checks.

Without CUDA the kernels run in Triton's interpreter (fp32/fp16); with CUDA the same cases run in bf16 too.
"""

import pytest
import torch
from test_kernels import CASE_DTYPES, CASES, assert_close, case_batch, make_batch, poisoned_out

from hfpaged.kernels import paged_attention, paged_attention_reference, store_kv_reference
from hfpaged.kernels.attention_config import AttentionConfig
from hfpaged.kernels.paged_attention import paged_attention_with_config

CUDA = torch.cuda.is_available()


def _sinks(num_heads, device, dtype=torch.float32, seed=1):
    # logits comparable to the scores (~N(0, 1)): the sink takes a real share of every row's softmax
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_heads, generator=gen) * 4 - 1).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype_override", CASE_DTYPES, ids=lambda d: "bf16" if d else "base")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_paged_attention_with_sinks_matches_reference(case, dtype_override):
    batch, kwargs, dtype = case_batch(case, dtype_override)
    kwargs["sinks"] = _sinks(case[3], batch["q"].device)
    ref = paged_attention_reference(**batch, **kwargs)
    without = paged_attention_reference(**batch, **{**kwargs, "sinks": None})
    assert not ref.isnan().any()
    # the sinks change every row that has a key (the reference is not quietly ignoring them)
    assert bool(((ref.float() - without.float()).abs().amax(dim=(1, 2)) > 1e-3).all())
    assert_close(paged_attention(**batch, **kwargs), ref, dtype)
    # decode tiles with the context split in 3 and 4 (the merge adds the sink once), a wide prompt tile
    configs = (AttentionConfig(16, 16, 4, 1, num_splits=3), AttentionConfig(16, 32, 4, 1, num_splits=4),
               AttentionConfig(64, 32, 4, 1))  # fmt: skip
    for config in configs:
        out = paged_attention_with_config(**batch, **kwargs, config=config, out=poisoned_out(batch))
        assert_close(out, ref, dtype)


def test_sinks_in_the_decode_kernel_that_stores_its_rows():
    # one query per sequence, slots given: the kernel writes K/V itself (one_query), then attends with the sinks
    q_lens, seq_lens = [1, 1, 1], [7, 40, 19]
    dtype = torch.float32
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(3, 2, 64, generator=gen).to(batch["q"].device)
    value = torch.randn(3, 2, 64, generator=gen).to(batch["q"].device)
    tables = batch["block_tables"].long()
    slots = torch.stack([tables[b, (s - 1) // 16] * 16 + (s - 1) % 16 for b, s in enumerate(seq_lens)])
    sinks = _sinks(4, batch["q"].device)
    ref_batch = {**batch, "k_cache": batch["k_cache"].clone(), "v_cache": batch["v_cache"].clone()}
    store_kv_reference(key, value, ref_batch["k_cache"], ref_batch["v_cache"], slots)
    ref = paged_attention_reference(**ref_batch, scale=0.125, sinks=sinks)
    out = paged_attention(
        **batch, scale=0.125, sinks=sinks, max_seqlen_q=1, max_seqlen_k=40, key=key, value=value,
        slot_mapping=slots.int(),
    )  # fmt: skip
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_sinks_with_fp8_caches(cache_dtype):
    q_lens, seq_lens = [1, 1, 20, 6], [30, 70, 20, 50]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    scales = {"k_scale": torch.tensor([0.02], device=batch["q"].device),
              "v_scale": torch.tensor([0.03], device=batch["q"].device)}  # fmt: skip
    for name in ("k_cache", "v_cache"):
        scale = scales["k_scale" if name == "k_cache" else "v_scale"]
        batch[name] = (batch[name].float() / scale).clamp(-200, 200).to(cache_dtype)
    sinks = _sinks(4, batch["q"].device, dtype=torch.bfloat16)  # the module's dtype: read as it is
    ref = paged_attention_reference(**batch, **scales, scale=0.125, sinks=sinks)
    for config in (AttentionConfig(16, 32, 4, 1, num_splits=3), AttentionConfig(64, 32, 4, 1)):
        out = paged_attention_with_config(**batch, **scales, scale=0.125, sinks=sinks, config=config)
        assert_close(out, ref, torch.float16)


def test_reference_sinks_equal_the_models_eager_formula():
    # GPT-OSS's eager attention: scores with the sink appended as one more logit, softmax, the sink's column dropped
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, seq_len, head_dim, block_size = 4, 2, 11, 16, 4
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(num_heads, generator=gen, dtype=torch.float64) * 2
    scale = head_dim**-0.5
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * scale
    scores = scores.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    combined = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, seq_len, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    expected = torch.einsum("hqk,khd->qhd", probs, vr)
    num_blocks = -(-seq_len // block_size)
    k_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:seq_len], v_cache[:seq_len] = k, v
    out = paged_attention_reference(
        q, k_cache.view(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache.view(num_blocks, block_size, num_kv_heads, head_dim),
        torch.arange(num_blocks, dtype=torch.int32)[None], torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, seq_len], dtype=torch.int32), scale=scale, sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # the interpreter's numpy: inf, as on a GPU
def test_extreme_sinks():
    # a sink of -inf adds nothing; a very large one takes the whole softmax (output -> 0) without turning into NaN
    batch = make_batch([1, 3], [9, 12], num_heads=2, num_kv_heads=1, head_dim=32, block_size=8, dtype=torch.float32)
    device = batch["q"].device
    plain = paged_attention(**batch, scale=0.2)
    minus_inf = torch.full((2,), float("-inf"), device=device)
    assert_close(paged_attention(**batch, scale=0.2, sinks=minus_inf), plain, torch.float32)
    huge = torch.full((2,), 500.0, device=device)
    for config in (AttentionConfig(16, 16, 4, 1, num_splits=2), AttentionConfig(16, 16, 4, 1)):
        out = paged_attention_with_config(**batch, scale=0.2, sinks=huge, config=config)
        assert not out.isnan().any() and out.abs().max() < 1e-30


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_gpu_gpt_oss_heads_with_sinks_bf16(window):
    # GPT-OSS-20B's attention: 64 query heads over 8 KV heads of 64 dims, bf16 sinks, alternating 128-token windows;
    # long decodes (split context), a 2k prompt, a chunk after cached context, short decodes
    q_lens, seq_lens = [1, 1, 2048, 300, 1, 1], [9000, 3000, 2048, 1800, 40, 700]
    batch = make_batch(q_lens, seq_lens, num_heads=64, num_kv_heads=8, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, table_tail="minus1")  # fmt: skip
    sinks = _sinks(64, batch["q"].device, dtype=torch.bfloat16)
    kwargs = dict(scale=0.125, sliding_window=window, sinks=sinks)
    ref = paged_attention_reference(**batch, **kwargs)
    assert_close(paged_attention(**batch, **kwargs), ref, torch.bfloat16)
    decode = {key: value[:2] if key in ("block_tables", "seq_lens") else value for key, value in batch.items()}
    decode.update(q=batch["q"][:2], cu_seqlens_q=batch["cu_seqlens_q"][:3])
    out = paged_attention(**decode, **kwargs, max_seqlen_q=1, max_seqlen_k=9000)  # two sequences: split context
    assert_close(out, paged_attention_reference(**decode, **kwargs), torch.bfloat16)


@pytest.mark.parametrize(
    "sinks,error,pattern",
    [
        (torch.zeros(3), ValueError, r"sinks.shape\[0\] must be 4"),
        (torch.zeros(4, 1), ValueError, "sinks must have 1 dimensions"),
        (torch.zeros(4, dtype=torch.int32), TypeError, "sinks must have dtype"),
        ([0.0] * 4, TypeError, "sinks must be a torch.Tensor"),
    ],
)
def test_bad_sinks_are_refused(sinks, error, pattern):
    batch = make_batch([1, 2], [5, 6], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    if isinstance(sinks, torch.Tensor):
        sinks = sinks.to(batch["q"].device)
    with pytest.raises(error, match=pattern):
        paged_attention(**batch, scale=0.25, sinks=sinks)


def test_sinks_of_any_float_dtype_and_stride():
    # a model's sinks may be float64 or a strided view (made on the device: a copy there would be contiguous); the
    # kernels read a float32 copy of those, the others as they are
    batch = make_batch([1, 7], [30, 7], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    device = batch["q"].device
    packed = _sinks(8, device)
    ref = paged_attention_reference(**batch, scale=0.25, sinks=packed[::2].contiguous())
    for sinks in (packed[::2], packed[::2].double(), packed[::2].half(), packed[::2].contiguous()):
        expected = ref if sinks.dtype != torch.float16 else paged_attention_reference(**batch, scale=0.25, sinks=sinks)
        assert_close(paged_attention(**batch, scale=0.25, sinks=sinks), expected, torch.float32)


# ---- the engine: models that pass sinks, against stock generate -------------------------------------------------


def _sink_model(arch: str, device=None):
    from models import make_more_model

    model = make_more_model(arch)
    sinks = [p for name, p in model.named_parameters() if name.endswith("sinks")]
    assert sinks
    with torch.no_grad():
        for p in sinks:  # larger than the init's: the sinks then decide tokens (checked below)
            p.normal_(0.0, 1.5, generator=torch.Generator().manual_seed(7))
    return model.to(device or ("cuda" if CUDA else "cpu")), sinks


def _without_sinks(model, sinks, prompts, **kwargs):
    """Stock generate with every sink at -1e30 (no share): what hfpaged would give if it dropped them."""
    from models import reference_generate

    saved = [p.detach().clone() for p in sinks]
    with torch.no_grad():
        for p in sinks:
            p.fill_(-1e30)
        try:
            return reference_generate(model, prompts, **kwargs)
        finally:
            for p, value in zip(sinks, saved):
                p.copy_(value)


# Granite-SWA's eager attention writes the sink as a sigmoid of the log-sum-exp; the Triton backend (interpreted on
# the CPU: ~10 s a model) runs once, for GPT-OSS
@pytest.mark.parametrize("arch,backend", [("gpt_oss", "torch"), ("gpt_oss", "triton"), ("granite_swa", "torch")])
def test_sink_models_are_exact_under_swap_three_callers_and_prefix_hits(arch, backend):
    from models import generate_in_threads, random_prompts, reference_generate

    import hfpaged

    model, sinks = _sink_model(arch)
    shared = random_prompts([12], seed=4)[0]  # a prefix of three whole blocks, shared by half the prompts
    prompts = random_prompts([5, 17, 9, 30, 3, 11], seed=5)
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    settings = dict(max_new_tokens=12, do_sample=False)
    expected = reference_generate(model, prompts, **settings)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2  # the continuations vary
    assert _without_sinks(model, sinks, prompts, **settings) != expected  # the sinks decide tokens here
    hfpaged.patch(
        model, num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="swap",
        swap_space=0.01, attention_backend=backend,
    )  # fmt: skip
    assert all(layer.sinks_dtype == torch.float32 for layer in model._hfpaged.layers if layer.sliding_window)
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == expected
    stats = hfpaged.stats(model)
    assert stats["num_swapped_out"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    # three callers at once; the prompts' blocks cached by the first call are hits
    results = generate_in_threads(model, [dict(prompt=p, **settings) for p in prompts], callers=3)
    assert results == [expected[i::3] for i in range(3)]
    assert hfpaged.stats(model)["prefix_cache_hits"] > stats["prefix_cache_hits"]


def test_sinks_changed_in_place_are_read_by_the_next_call():
    # the kernels read the module's parameter in every step (CUDA graphs included: Granite-SWA, a dense model, replays
    # float32 steps from graphs; float32 MoE models run eagerly on CUDA, tests/test_architectures.py)
    from models import random_prompts, reference_generate

    import hfpaged

    model, sinks = _sink_model("granite_swa")
    prompts = random_prompts([6, 14, 25], seed=6)
    settings = dict(max_new_tokens=10, do_sample=False)
    hfpaged.patch(model, num_blocks=24, block_size=4)
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == reference_generate(
        model, prompts, **settings
    )
    with torch.no_grad():
        for p in sinks:
            p.mul_(-2.0).add_(1.0)
    expected = reference_generate(model, prompts, **settings)  # stock generate of the patched model, new sinks
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == expected
    assert (model._hfpaged.engine.runner.num_graph_steps > 0) == CUDA


def test_a_model_whose_sinks_are_float64_or_strided_is_served_exactly():
    # before: patch accepted them and every step of the Triton backend then failed on the kernels' checks
    from models import random_prompts, reference_generate

    import hfpaged

    model, _ = _sink_model("gpt_oss", device="cpu")
    layers = model.model.layers
    num_heads = layers[0].self_attn.sinks.shape[0]
    del layers[0].self_attn.sinks
    layers[0].self_attn.sinks = torch.randn(2 * num_heads, generator=torch.Generator().manual_seed(2))[::2]
    layers[1].self_attn.sinks = torch.nn.Parameter(layers[1].self_attn.sinks.detach().double())
    model.to("cuda" if CUDA else "cpu")
    if CUDA:  # the view again, made on the device (moving it made it contiguous)
        layers[0].self_attn.sinks = torch.randn(2 * num_heads, device="cuda")[::2]
    prompts = random_prompts([5, 12, 20], seed=8)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    hfpaged.patch(model, num_blocks=24, block_size=4, attention_backend="triton")
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=8, do_sample=False)] == expected
