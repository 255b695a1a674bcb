"""One-row projections by the Triton GEMV (kernels/gemv.py, EngineConfig.gemv) on the CPU, in Triton's interpreter
(conftest sets TRITON_INTERPRET=1): the kernel against a float32 reference, its argument checks, and the engine's
routing (one-row steps only, every projection and the LM head, nothing left behind by unpatch)."""

import pytest
import torch
from models import generate_in_threads, make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.kernels import gemv as gemv_kernels
from hfpaged.kernels.gemv import GEMV_MAX_ROWS, MAX_K_PAD, gemv_supports, linear_few_rows

NEW = 8


@pytest.mark.parametrize("shape", [(64, 64), (100, 48), (33, 200), (7, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_gemv_matches_a_float32_reference(shape, bias):
    num_features, in_features = shape
    gen = torch.Generator().manual_seed(num_features)
    weight = (torch.randn(num_features, in_features, generator=gen) / in_features**0.5).half()
    b = torch.randn(num_features, generator=gen).half() if bias else None
    for x in (torch.randn(1, in_features, generator=gen).half(), torch.randn(1, 1, in_features, generator=gen).half(),
              torch.randn(2, in_features, generator=gen).half()[1:]):  # fmt: skip
        out = linear_few_rows(x, weight, b)
        ref = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
        assert out.shape == ref.shape and out.dtype == torch.float16
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    rows = torch.randn(GEMV_MAX_ROWS, in_features, generator=gen).half()
    ref = torch.nn.functional.linear(rows.float(), weight.float(), None if b is None else b.float())
    torch.testing.assert_close(linear_few_rows(rows, weight, b).float(), ref, atol=2e-3, rtol=2e-3)


def _rms_norm(x, weight, eps):
    """transformers' Llama-family RMSNorm, as its modules compute it."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(64, 64), (100, 48), (33, 200), (7, 1000)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("norm,residual", [(True, False), (False, True), (True, True)], ids=["norm", "res", "both"])
def test_gemv_with_its_norm_and_residual_add_equals_the_unfused_ops(shape, norm, residual):
    num_features, in_features = shape
    gen = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(num_features, in_features, generator=gen) / in_features**0.5).half()
    bias = torch.randn(num_features, generator=gen).half()
    norm_weight = (1 + 0.2 * torch.randn(in_features, generator=gen)).half() if norm else None
    for b in (None, bias):
        x = (3 * torch.randn(1, 1, in_features, generator=gen)).half()
        res = torch.randn(1, 1, num_features, generator=gen).half() if residual else None
        normed = _rms_norm(x, norm_weight, 1e-5) if norm else x
        expected = torch.nn.functional.linear(normed.float(), weight.float(), None if b is None else b.float()).half()
        if residual:
            expected = res + expected  # a float16 add, rounded once
        out = linear_few_rows(x, weight, b, norm_weight=norm_weight, norm_eps=1e-5, residual=res)
        assert out.shape == expected.shape and out.dtype == torch.float16
        # the same roundings in the same order; the sums (norm and dot) in another order than torch's
        torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    if norm:  # eps is used: a zero row normalizes to zero with eps > 0
        zero = torch.zeros(1, in_features).half()
        assert linear_few_rows(zero, weight, norm_weight=norm_weight, norm_eps=1e-5).abs().max() == 0


def test_gemv_refuses_what_it_does_not_take():
    weight = torch.randn(16, 32).half()
    with pytest.raises(ValueError, match="at most"):
        linear_few_rows(torch.randn(GEMV_MAX_ROWS + 1, 32).half(), weight)
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\] torch.float16"):
        linear_few_rows(torch.randn(1, 32), weight)  # float32 input for a float16 weight
    with pytest.raises(ValueError, match="unit stride"):
        linear_few_rows(torch.randn(1, 32), torch.randn(16, 32))  # float32 weight
    with pytest.raises(ValueError, match="unit stride"):
        linear_few_rows(torch.randn(1, 16).half(), weight.t())  # strided along its input
    with pytest.raises(ValueError, match="bias"):
        linear_few_rows(torch.randn(1, 32).half(), weight, torch.randn(8).half())
    wide = torch.zeros(2, MAX_K_PAD + 1).half()  # an input too wide for one row per program: cuBLAS keeps it
    assert not gemv_supports(wide) and gemv_supports(wide[:, :MAX_K_PAD])
    with pytest.raises(ValueError, match=f"at most {MAX_K_PAD}"):
        linear_few_rows(torch.zeros(1, MAX_K_PAD + 1).half(), wide)
    with pytest.raises(ValueError, match="launch_pdl=True needs a CUDA GPU"):
        linear_few_rows(torch.randn(1, 32).half(), weight, launch_pdl=True)
    x = torch.randn(1, 32).half()
    with pytest.raises(ValueError, match=r"norm_weight must be \[32\] torch.float16, got \[16\]"):
        linear_few_rows(x, weight, norm_weight=torch.ones(16).half())
    with pytest.raises(ValueError, match=r"norm_weight must be \[32\] torch.float16, got \[32\] torch.float32"):
        linear_few_rows(x, weight, norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match=r"residual must be \[1, 16\] torch.float16 .*got \[1, 32\]"):
        linear_few_rows(x, weight, residual=torch.ones(1, 32).half())
    with pytest.raises(ValueError, match=r"residual must be .*got \[1, 16\] torch.float32"):
        linear_few_rows(x, weight, residual=torch.ones(1, 16))


@pytest.fixture
def gemv_calls(monkeypatch):
    """Weight shapes of every GEMV call (the custom op looks the function up at each call)."""
    calls = []
    original = gemv_kernels.linear_few_rows

    def spy(x, weight, bias=None, **kwargs):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return original(x, weight, bias, **kwargs)

    monkeypatch.setattr(gemv_kernels, "linear_few_rows", spy)
    return calls


@pytest.mark.parametrize("arch,fuse", [("llama", True), ("qwen3", None)], ids=["llama_fused", "qwen3_unfused"])
def test_one_row_steps_take_the_gemv_and_stay_greedy_exact(arch, fuse, gemv_calls):
    # float16 on the CPU: the GEMV sums in float32 like the stock matmul; these prompts give the same tokens.
    model = make_model(arch, dtype=torch.float16)
    prompts = random_prompts([5, 11], seed=4)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    before = {name: module.forward for name, module in model.named_modules()}
    hfpaged.patch(model, num_blocks=48, block_size=4, gemv=True, fuse_projections=fuse)
    fused = model._hfpaged.fused_projections
    layers = model.config.num_hidden_layers
    # fused: q/k/v and gate/up as two groups, o and down alone; unfused (the CPU default): seven projections; and
    # the LM head
    assert fused.num_gemv == (4 if fuse else 7) * layers + 1
    assert sum(s[2] is model.get_output_embeddings() for s in fused.singles) == 1
    results = model.generate_many(prompts[:1], max_new_tokens=NEW, do_sample=False)
    assert [r.token_ids for r in results] == expected[:1]
    # the prompt step has rows: stock, but for its LM head (one sampled row); each of the NEW - 1 decode steps: one
    # call per projection
    assert len(gemv_calls) == (NEW - 1) * fused.num_gemv + 1
    assert all(x[:-1] in ((1,), (1, 1)) for x, _ in gemv_calls)
    gemv_calls.clear()
    results = model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)  # two rows per step: no GEMV
    assert [r.token_ids for r in results] == expected and gemv_calls == []
    hfpaged.unpatch(model)
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert {name: module.forward for name, module in model.named_modules()}.keys() == before.keys()
    assert reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False) == expected


def test_gemv_off_by_option_and_on_cpu_by_default(gemv_calls):
    model = make_model("llama", dtype=torch.float16)
    prompts = random_prompts([6], seed=2)
    for options in ({}, {"gemv": False}):  # the CPU default: off (no dependent launch)
        hfpaged.patch(model, num_blocks=32, block_size=4, **options)
        assert model._hfpaged.fused_projections.num_gemv == 0
        model.generate_many(prompts, max_new_tokens=4, do_sample=False)
        assert gemv_calls == []
        hfpaged.unpatch(model)


def test_float32_weights_keep_cublas_and_parity(gemv_calls):
    # the GEMV takes 16-bit weights only: a float32 model patched with gemv=True routes nothing, exact as before
    model = make_model("qwen3")
    prompts = random_prompts([7], seed=6)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4, gemv=True)
    assert model._hfpaged.fused_projections.num_gemv == 0
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)] == expected
    assert gemv_calls == []


def test_bad_gemv_setting_leaves_the_model_unpatched(monkeypatch):
    model = make_model("llama", dtype=torch.float16)
    prompts = random_prompts([5], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="gemv must be True, False or None"):
        hfpaged.patch(model, gemv="yes")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU without the interpreter cannot run the kernel
    with pytest.raises(ValueError, match="gemv=True runs Triton kernels"):
        hfpaged.patch(model, num_blocks=32, block_size=4, gemv=True)
    with pytest.raises(ValueError, match="attention_backend='triton' runs Triton kernels: it needs CUDA devices"):
        hfpaged.patch(model, num_blocks=32, block_size=4, attention_backend="triton")
    assert not hasattr(model, "_hfpaged")
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    assert reference_generate(model, prompts, max_new_tokens=4, do_sample=False) == expected


def test_one_row_steps_under_preemption_swap_threads_and_changed_weights(gemv_calls):
    # A pool too small for the batch: the scheduler preempts (recompute, then swap) and the steps that hold a single
    # sequence take the GEMV; callers in threads share steps; weights changed in place reach the GEMV at the next
    # call. Tokens equal stock generate in every case.
    model = make_model("llama", dtype=torch.float16, seed=3)
    prompts = random_prompts([3, 17, 9, 33, 5, 24, 12, 40], seed=12)
    expected = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    options = dict(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, gemv=True)
    for mode in ("recompute", "swap"):
        hfpaged.patch(model, **options, preemption_mode=mode)
        got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=12, do_sample=False)]
        assert got == expected, mode
        assert hfpaged.stats(model)["num_preemptions"] > 0 and gemv_calls, mode
        gemv_calls.clear()
    results = generate_in_threads(model, prompts, timeout=300, max_new_tokens=12, do_sample=False)
    assert results == [expected[i::3] for i in range(3)] and gemv_calls
    with torch.no_grad():  # changed in place while patched: the next call must use the new values
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
        model.model.layers[1].self_attn.o_proj.weight.mul_(2.0)
        lm_head = model.get_output_embeddings().weight  # the LM head takes the GEMV too
        lm_head.add_(torch.randn(lm_head.shape, generator=torch.Generator().manual_seed(0)).to(lm_head.dtype) * 0.05)
    gemv_calls.clear()
    got = model.generate_many(prompts[:1], max_new_tokens=12, do_sample=False)[0].token_ids
    assert gemv_calls
    hfpaged.unpatch(model)
    changed = reference_generate(model, prompts[:1], max_new_tokens=12, do_sample=False)[0]
    assert changed != expected[0] and got == changed
