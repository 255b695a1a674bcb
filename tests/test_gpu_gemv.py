"""One-row projections by the Triton GEMV on CUDA (EngineConfig.gemv; run with `pytest -m gpu` on a GPU): the kernel
in bf16 with dependent launch inside a CUDA graph, batch-1 decode graphs with it (compiled and eager layers) against
stock generate next to the yardstick (stock eager vs sdpa), and a weight changed in place after capture."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.kernels import gemv as gemv_kernels
from hfpaged.kernels.dependent_launch import dependent_launch_supported
from hfpaged.kernels.gemv import linear_few_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 3072), (3072, 2048), (300, 72)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_bf16_in_a_graph_with_dependent_launch(shape):
    num_features, in_features = shape
    pdl = dependent_launch_supported(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(num_features, in_features, device="cuda", generator=gen) / in_features**0.5).bfloat16()
    bias = torch.randn(num_features, device="cuda", generator=gen).bfloat16()
    x = torch.randn(1, in_features, device="cuda", generator=gen).bfloat16()
    ref = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    eager = linear_few_rows(x, weight, bias, launch_pdl=pdl)
    torch.testing.assert_close(eager.float(), ref, atol=2e-2, rtol=1e-2)
    # a chain in one graph: each call reads the previous output (through a copy into x), so a read before the wait
    # would show; replayed against eager calls of the same chain
    chain_x = x.clone()

    def chain():
        outs = []
        for _ in range(4):
            out = linear_few_rows(chain_x, weight, bias, launch_pdl=pdl)
            chain_x.copy_(out.repeat(1, -(-in_features // num_features))[:, :in_features])
            outs.append(out)
        return outs

    chain_x.copy_(x)
    expected = [o.clone() for o in chain()]
    graph = torch.cuda.CUDAGraph()
    chain_x.copy_(x)
    with torch.cuda.graph(graph):
        captured = chain()
    chain_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        assert torch.equal(got, want)


def _greedy_alone(model, prompts, new):
    return [model.generate_many([p], max_new_tokens=new, do_sample=False)[0].token_ids for p in prompts]


@pytest.mark.parametrize("compile", [None, False], ids=["compiled", "eager_layers"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batch1_graphs_with_the_gemv_next_to_the_yardstick(arch, compile, monkeypatch):
    calls = []
    original = gemv_kernels.linear_few_rows

    def spy(x, weight, bias=None, **kwargs):
        calls.append(tuple(weight.shape))
        return original(x, weight, bias, **kwargs)

    monkeypatch.setattr(gemv_kernels, "linear_few_rows", spy)
    new = 24
    model = make_model(arch, dtype=torch.bfloat16).cuda()
    prompts = random_prompts([4, 9, 17, 30, 6, 12], seed=11)
    stock = reference_generate(model, prompts, max_new_tokens=new, do_sample=False)
    model.set_attn_implementation("eager")
    yardstick = reference_generate(model, prompts, max_new_tokens=new, do_sample=False)
    model.set_attn_implementation("sdpa")
    shares = {}
    for gemv in (None, False):
        calls.clear()
        hfpaged.patch(model, num_blocks=64, block_size=8, max_num_seqs=4, compile=compile, gemv=gemv)
        runner = model._hfpaged.engine.runner
        got = _greedy_alone(model, prompts, new)
        on = model._hfpaged.fused_projections.num_gemv > 0
        assert on == (gemv is None and dependent_launch_supported(torch.device("cuda")))
        if on:
            assert runner.graphs is not None and runner.graphs.buckets[0] == 1 and calls  # captured with the GEMV
            assert runner.graphs.capture_retries == 0  # batch 1 compiled before its capture (warm_smallest)
        else:
            assert not calls
        assert runner.num_graph_steps > 0
        shares[gemv] = sum(g == s for g, s in zip(got, stock)) / len(prompts)
        assert sum(g[0] == s[0] for g, s in zip(got, stock)) >= len(prompts) - 1
        hfpaged.unpatch(model)
    yard = sum(y == s for y, s in zip(yardstick, stock)) / len(prompts)
    print(f"{arch} bf16 batch-1, prompts matching stock on all {new} tokens: gemv {shares[None]:.0%}, "
          f"cuBLAS {shares[False]:.0%}; yardstick (stock eager vs sdpa) {yard:.0%}")  # fmt: skip


@pytest.mark.parametrize("what", ["projections", "norms"])
def test_weights_changed_in_place_after_capture_reach_the_gemv(what):
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    prompt = random_prompts([9], seed=3)
    hfpaged.patch(model, num_blocks=64, block_size=8, max_num_seqs=4)
    assert model._hfpaged.fused_projections.num_gemv > 0
    model.generate_many(prompt, max_new_tokens=8, do_sample=False)  # graphs captured with the old values
    with torch.no_grad():  # attention and MLP outputs zero: the residual stream is the embedding, exactly
        for layer in model.model.layers:
            if what == "projections":
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            else:  # the norms run inside the compiled layers' GEMVs (gemv_fusion.py): zero rows in, zero out
                layer.input_layernorm.weight.zero_()
                layer.post_attention_layernorm.weight.zero_()
    got = model.generate_many(prompt, max_new_tokens=8, do_sample=False)[0].token_ids
    hfpaged.unpatch(model)
    assert got == reference_generate(model, prompt, max_new_tokens=8, do_sample=False)[0]
