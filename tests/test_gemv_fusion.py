"""A one-row projection's RMSNorm and residual add inside its GEMV (hfpaged/model/gemv_fusion.py, Inductor's post-grad
pass): what it fuses and what it leaves in small compiled functions, and the compiled batch-1 decode of tiny models
through it against stock generate, also with norm weights changed in place (CPU, Triton's interpreter, float16)."""

import pytest
import torch
from models import generate_in_threads, make_model, random_prompts, reference_generate
from test_compiled import _decode_with
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import hfpaged
from hfpaged.kernels import gemv as gemv_kernels
from hfpaged.model import custom_ops, gemv_fusion

WIDTH = 48


class _Recorder(gemv_fusion.GemvFusionPass):
    """The pass, keeping the call targets and GEMV arguments of the graph it leaves."""

    def __call__(self, graph):
        super().__call__(graph)
        self.targets = [n.target for n in graph.nodes if n.op == "call_function"]
        self.gemvs = [n.args for n in graph.nodes if n.target is torch.ops.hfpaged.gemv_fused.default]


def _compile(fn, *args):
    """(eager output, compiled output, the recorder) of ``fn(*args)`` compiled with the pass."""
    custom_ops.register_custom_ops()
    recorder = _Recorder()
    compiled = torch.compile(fn, options={"post_grad_custom_post_pass": recorder, "fx_graph_cache": False})
    with torch.no_grad():
        return fn(*args), compiled(*args), recorder


def _norm(cls):
    norm = cls(WIDTH, eps=1e-5).half()
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(WIDTH, generator=torch.Generator().manual_seed(1)))
    return norm


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return (3 * torch.randn(1, 1, WIDTH, generator=gen)).half(), (torch.randn(WIDTH, WIDTH, generator=gen) / 7).half()


def gemv(x, weight):
    return torch.ops.hfpaged.gemv(x, weight, None, False)


def test_a_llama_norm_and_the_residual_add_go_into_the_gemv():
    norm = _norm(LlamaRMSNorm)
    eager, compiled, seen = _compile(lambda h, w: h + gemv(norm(h), w), *_inputs())
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert torch.ops.hfpaged.gemv.default not in seen.targets and torch.ops.aten.rsqrt.default not in seen.targets
    assert torch.ops.aten.add.Tensor not in seen.targets
    (args,) = seen.gemvs  # one kernel: the norm of h, the projection and the residual add
    assert args[4] is not None and args[7] is not None


def test_other_norms_and_shared_values_stay_outside():
    h, w = _inputs()
    gemma_norm = _norm(Gemma2RMSNorm)
    # Gemma2's norm (1 + weight) is not the Llama-family one: it stays; the residual add still goes in
    eager, compiled, seen = _compile(lambda h, w: h + gemv(gemma_norm(h), w), h, w)
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert torch.ops.aten.rsqrt.default in seen.targets and [a[4] for a in seen.gemvs] == [None]
    norm = _norm(LlamaRMSNorm)

    def shared_norm(h, w):
        normed = norm(h)
        return h + gemv(normed, w), normed * 2

    # the normalized row is also used elsewhere: the norm is computed once, outside
    eager, compiled, seen = _compile(shared_norm, h, w)
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert torch.ops.aten.rsqrt.default in seen.targets and [a[4] for a in seen.gemvs] == [None]

    def shared_projection(h, w):
        projected = gemv(norm(h), w)
        return h + projected, projected * 2

    # the projection is also used elsewhere: no residual add inside it
    eager, compiled, seen = _compile(shared_projection, h, w)
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert torch.ops.aten.add.Tensor in seen.targets and all(a[7] is None for a in seen.gemvs)
    # a broadcast add (a [WIDTH] bias-like operand) is not a residual of the output's shape
    bias = torch.randn(WIDTH).half()
    eager, compiled, seen = _compile(lambda h, w: bias + gemv(h, w), h, w)
    torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=2e-3)
    assert seen.gemvs == [] and torch.ops.hfpaged.gemv.default in seen.targets


def test_the_switch_leaves_the_layers_as_inductor_has_them(monkeypatch):
    assert "post_grad_custom_post_pass" in custom_ops.inductor_options(False)
    monkeypatch.setattr(gemv_fusion, "ENABLED", False)
    assert "post_grad_custom_post_pass" not in custom_ops.inductor_options(False)


@pytest.fixture
def fused_calls(monkeypatch):
    """(norm inside?, residual inside?) of every GEMV call."""
    calls = []
    original = gemv_kernels.linear_few_rows

    def spy(x, weight, bias=None, **kwargs):
        calls.append((kwargs.get("norm_weight") is not None, kwargs.get("residual") is not None))
        return original(x, weight, bias, **kwargs)

    monkeypatch.setattr(gemv_kernels, "linear_few_rows", spy)
    return calls


def _compiled_batch1_decode(arch: str, fuse: bool):
    """A float16 ``arch`` model patched with compiled layers and the GEMV (fused projections or not), one prompt
    decoded through the compiled forward (test_compiled._decode_with), checked against stock generate: (model,
    prompts, stock tokens)."""
    model = make_model(arch, dtype=torch.float16)
    prompts = random_prompts([7], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    options = dict(attention_backend="triton", gemv=True, fuse_projections=fuse, compile_cache_dir="")
    hfpaged.patch(model, num_blocks=64, block_size=4, async_scheduling=False, compile=True, **options)
    generated, _ = _decode_with(model, hfpaged.Engine(model).core.runner, prompts, 6)
    assert generated == expected
    return model, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("arch,fuse", [("llama", True), ("qwen3", False)], ids=["llama_fused", "qwen3_unfused"])
def test_compiled_batch1_decode_through_the_fused_gemv_equals_stock(arch, fuse, fused_calls):
    model, prompts, expected = _compiled_batch1_decode(arch, fuse)
    layers = model.config.num_hidden_layers
    # in each of the 5 decode steps, per layer: q/k/v and gate/up read the norms (2 fused GEMVs, or 5 projections
    # unfused), o and down add the residual; the LM head (outside the compiled layers) runs plain, also for the
    # prompt step's sampled row
    expected_calls = {(True, False): 5 * (2 if fuse else 5) * layers, (False, True): 5 * 2 * layers, (False, False): 6}
    assert {k: fused_calls.count(k) for k in expected_calls} == expected_calls and len(fused_calls) == sum(
        expected_calls.values()
    )
    with torch.no_grad():  # norm weights changed in place (graphs compiled): the next steps read the new values
        for layer in model.model.layers:
            layer.input_layernorm.weight.mul_(1.5)
            layer.post_attention_layernorm.weight.mul_(-0.75)
    generated, _ = _decode_with(model, model._hfpaged.engine.runner, prompts, 6)
    hfpaged.unpatch(model)
    changed = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    assert changed != expected and generated == changed


@pytest.mark.slow
@pytest.mark.parametrize("arch,neighbours", [("opt", {(False, True)}), ("gemma2", set())])
def test_other_architectures_take_what_matches_and_stay_exact(arch, neighbours, fused_calls):
    # OPT: LayerNorms (not matched), residual adds of its biased projections (fused); Gemma2: its norms are not the
    # Llama-family one and its residual adds add norm outputs (nothing fused). Greedy equals stock either way.
    _compiled_batch1_decode(arch, True)
    assert {call for call in fused_calls if call != (False, False)} == neighbours


@pytest.mark.slow
def test_fused_gemv_steps_under_preemption_swap_threads_and_changed_weights(fused_calls):
    # The engine's own path: graphs "replayed" eagerly on the CPU (test_graph_padding.replay_eagerly) around the
    # compiled layers, so one-sequence steps run the batch-1 graph's forward, GEMVs fused. A pool too small for the
    # batch (recompute, then swap preemption), callers in threads, norm and projection weights changed in place:
    # greedy equals stock generate throughout.
    from test_graph_padding import replay_eagerly

    model = make_model("llama", dtype=torch.float16, seed=3)
    prompts = random_prompts([3, 17, 9, 33, 5, 24, 12, 40], seed=12)
    expected = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    options = dict(num_blocks=20, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, gemv=True, compile=True,
                   compile_cache_dir="", attention_backend="triton", fuse_projections=True)  # fmt: skip
    for mode in ("recompute", "swap"):
        hfpaged.patch(model, **options, preemption_mode=mode)
        replay_eagerly(model)
        got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=12, do_sample=False)]
        assert got == expected, mode
        assert hfpaged.stats(model)["num_preemptions"] > 0 and (True, False) in fused_calls, mode
        fused_calls.clear()
    results = generate_in_threads(model, prompts, max_new_tokens=12, do_sample=False)
    assert results == [expected[i::3] for i in range(3)]
    with torch.no_grad():  # changed in place while patched (layers compiled): the next call uses the new values
        model.model.layers[0].post_attention_layernorm.weight.mul_(-1.5)
        model.model.layers[1].self_attn.o_proj.weight.mul_(2.0)
    fused_calls.clear()
    got = model.generate_many(prompts[:1], max_new_tokens=12, do_sample=False)[0].token_ids
    assert (True, False) in fused_calls and (False, True) in fused_calls
    hfpaged.unpatch(model)
    changed = reference_generate(model, prompts[:1], max_new_tokens=12, do_sample=False)[0]
    assert changed != expected[0] and got == changed
