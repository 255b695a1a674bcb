"""The torch.compile decode path (patch(..., compile=True)): custom ops + metadata as forward kwargs.

On the GPU the runner captures this compiled forward in its decode CUDA graphs (tests/test_gpu_engine.py);
here it runs on the CPU, Triton kernels interpreted, and must decode exactly like stock generate. The
decoder layers are compiled as one region each, sharing one graph per distinct layer kind.
"""

import pytest
import torch
from models import make_model, random_prompts, reference_generate
from torch._dynamo.utils import counters

import hfpaged
from hfpaged.core.runner_output import ModelRunnerOutput
from hfpaged.model import custom_ops
from hfpaged.model.cuda_graphs import StepGraphs
from hfpaged.model.input_batch import device_views


def patch_compiled(model, **options):
    """``patch(compile=True)`` with the Triton custom ops, synchronous steps, no prefix cache, no compile cache."""
    hfpaged.patch(
        model,
        num_blocks=64,
        block_size=4,
        attention_backend="triton",
        enable_prefix_caching=False,
        async_scheduling=False,
        compile=True,
        **{"compile_cache_dir": "", **options},
    )


def compiled_decode(model, prompts, max_new_tokens=6, max_steps=None, **options):
    """Prefill eagerly, then drive scheduler and runner through the compiled decode forward (no step may be left
    in flight); (generated ids per prompt, the runner)."""
    patch_compiled(model, **options)
    return _decode_with(model, hfpaged.Engine(model).core.runner, prompts, max_new_tokens, max_steps)


@pytest.mark.slow
def test_compiled_decode_forward_matches_stock_generate():
    model = make_model("llama")
    prompts = random_prompts([5, 9, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    generated, runner = compiled_decode(model, prompts)
    assert runner._compiled is not None
    assert generated == expected
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]


def _num_compiled(function) -> int:
    """How many compiled entries dynamo holds for ``function``'s code (one per graph it compiled for it)."""
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(function.__code__))


def test_identical_layers_share_one_compiled_graph():
    torch._dynamo.reset()
    model = make_model("llama", num_hidden_layers=6)
    prompts = random_prompts([5, 9, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=2, do_sample=False)
    generated, runner = compiled_decode(model, prompts, max_new_tokens=2)
    assert generated == expected
    blocks, others = custom_ops.compile_regions(model)
    assert blocks == list(model.model.layers)
    assert model.model.norm in others and model.model.embed_tokens not in others
    assert _num_compiled(runner._compiled.block_function) == 1  # six layers, one graph
    assert all("forward" not in layer.__dict__ for layer in blocks + others)  # stock calls run uncompiled


def test_every_graph_bucket_shares_each_regions_graphs():
    # The decode CUDA graphs' capture (StepGraphs.capture, here without CUDA): the compiled forward once per batch
    # bucket, largest first, on views of the static input buffers. With compiled layers the runner leaves out
    # batch 1 (min_batch=2: a lone sequence pads into the 2-row graph), so each region compiles ONE graph for every
    # bucket; a batch-1 bucket would specialise a second one (dynamo specialises size 1: seen with min_batch=1). The fused projections'
    # per-member forwards used to make it a graph per layer, and duck sizing (the largest batch equals the
    # block-table buffer's rows) one more for the largest bucket, until dynamo's recompile limit (8) left the other
    # layers and buckets uncompiled.
    torch._dynamo.reset()
    counters.clear()
    model = make_model("qwen3", num_hidden_layers=3)
    patch_compiled(model, fuse_projections=True, max_num_seqs=8)
    runner = hfpaged.Engine(model).core.runner
    graphs = StepGraphs(torch.device("cpu"), 8, runner.graph_width, runner.block_size, min_batch=2)
    assert graphs.buckets == [2, 4, 8]
    assert graphs.bucket_for(1, 1) == 2  # a lone decode sequence
    with torch.inference_mode():
        for bucket in reversed(graphs.buckets):
            dummy = torch.from_numpy(graphs._dummy_inputs(bucket))
            graphs.static[: dummy.numel()].copy_(dummy)
            step = graphs._views(bucket)
            compiled = runner._graph_forward(step)
            torch.testing.assert_close(compiled, runner.forward(step, logits_indices=0), rtol=1e-4, atol=1e-4)
    # then the mixed (prefill + decode) graphs, by token bucket: the same compiled graphs serve them (their
    # max_seqlen_q hint, the bucket, shares the decode steps' symbol through MAX_SEQLEN_Q_OFFSET)
    mixed = StepGraphs(torch.device("cpu"), 8, runner.graph_width, runner.block_size, mixed=True, max_num_tokens=64)
    assert mixed.buckets == [16, 32, 64]
    with torch.inference_mode():
        for bucket in reversed(mixed.buckets):
            dummy = torch.from_numpy(mixed._dummy_inputs(bucket))
            mixed.static[: dummy.numel()].copy_(dummy)
            step = mixed._views(bucket)
            compiled = runner._graph_forward(step, mixed=True)
            assert compiled.shape[0] == mixed.shape(bucket)[1]  # the sampled rows only
            torch.testing.assert_close(compiled, runner.forward(step), rtol=1e-4, atol=1e-4)
    assert _num_compiled(runner._compiled.block_function) == 1  # three layers, six buckets of two kinds
    assert _num_compiled(runner._compiled.other_function) == 2  # the final norm and the rotary embedding
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]


def test_layers_trace_once_and_layers_with_other_floats_share_one_graph():
    # Float attributes are constants of the trace (custom_ops._constant_floats): left symbolic, the attention's
    # scaling reached the custom op as a float dynamo could not make a tensor, and the layer's whole trace restarted
    # (compile_attempt_1: ~2 s of every start on an H200). Where the layers' floats differ (a norm eps per layer,
    # PEFT's alpha_pattern) constants would compile a graph per layer, past dynamo's recompile limit (8) none: those
    # layers keep symbolic floats and share one graph, and must decode exactly either way.
    metrics = torch._dynamo.utils.compilation_time_metrics
    prompts = random_prompts([5, 9, 3], seed=2)
    for distinct_eps in (False, True):
        torch._dynamo.reset()
        metrics.clear()
        model = make_model("llama", num_hidden_layers=10)
        if distinct_eps:
            for i, layer in enumerate(model.model.layers):
                layer.input_layernorm.variance_epsilon = 1e-6 * 2**i
        expected = reference_generate(model, prompts, max_new_tokens=3, do_sample=False)
        generated, runner = compiled_decode(model, prompts, max_new_tokens=3)
        assert generated == expected
        assert _num_compiled(runner._compiled.block_function) == 1  # ten layers, one graph
        assert "compile_attempt_0" in metrics  # the metric read below exists in this torch
        assert ("compile_attempt_1" in metrics) == distinct_eps  # the restart only where the floats differ
        hfpaged.unpatch(model)


def test_floats_differ_reads_module_and_dict_attributes():
    model = make_model("llama", num_hidden_layers=3)
    layers = list(model.model.layers)
    assert not custom_ops._floats_differ(layers)
    layers[2].mlp.scaling = {"default": 2.0}  # as PEFT keeps a LoRA layer's scaling per adapter
    assert custom_ops._floats_differ(layers)
    for layer in layers[:2]:
        layer.mlp.scaling = {"default": 2.0}
    assert not custom_ops._floats_differ(layers)
    layers[0].mlp.scaling["default"] = 4.0
    assert custom_ops._floats_differ(layers)
    assert not custom_ops._floats_differ([])


@pytest.mark.slow
@pytest.mark.parametrize("arch,num_kinds", [("qwen3", 1), ("gemma2", 2)])  # gemma2: sliding and full layers
def test_regional_compile_matches_stock_generate(arch, num_kinds):
    torch._dynamo.reset()
    model = make_model(arch, num_hidden_layers=4)
    prompts = random_prompts([5, 9, 3], seed=2)
    expected = reference_generate(model, prompts, max_new_tokens=5, do_sample=False)
    assert len({tuple(e) for e in expected}) > 1 or len(set(expected[0])) > 1  # the continuation varies
    generated, runner = compiled_decode(model, prompts, max_new_tokens=5)
    assert generated == expected
    assert _num_compiled(runner._compiled.block_function) == num_kinds


# torch's own config.patch, not monkeypatch: pytest >= 9.2's monkeypatch restores a module attribute missing from the
# module's __dict__ (torch keeps its config entries elsewhere) by deleting it, and a deleted dynamo config entry then
# fails every later compile in that process
@torch._dynamo.config.patch(recompile_limit=1)
def test_each_compiled_forward_has_its_own_recompile_count():
    # dynamo counts compiled graphs per code object and, past config.recompile_limit, runs the code uncompiled
    # without an error. Two models (or a model patched twice) each compile their own graphs: with the limit at 1,
    # both engines below still compile (with one shared code object the second would run eager layers).
    torch._dynamo.reset()
    counters.clear()
    prompts = random_prompts([5, 9], seed=5)
    runners = []
    for arch in ("llama", "qwen3"):
        model = make_model(arch, num_hidden_layers=2)
        expected = reference_generate(model, prompts, max_new_tokens=3, do_sample=False)
        graphs_before = counters["stats"]["unique_graphs"]
        generated, runner = compiled_decode(model, prompts, max_new_tokens=3)
        assert generated == expected
        assert counters["stats"]["unique_graphs"] >= graphs_before + 2  # its layers' graph and another region's
        assert _num_compiled(runner._compiled.block_function) == 1
        runners.append(runner._compiled)
    assert runners[0].block_function.__code__ is not runners[1].block_function.__code__


def test_stock_forward_after_compiled_step_is_unchanged():
    torch._dynamo.reset()
    model = make_model("llama", num_hidden_layers=3)
    ids = torch.tensor([random_prompts([7], seed=3)[0]])
    with torch.no_grad():
        before = model(ids).logits
    compiled_decode(model, random_prompts([4, 6], seed=4), max_new_tokens=2, max_steps=1)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames  # the stock forward ran nothing compiled


@pytest.mark.slow
def test_whole_model_fallback_without_a_layer_list(monkeypatch):
    monkeypatch.setattr(custom_ops, "compile_regions", lambda model: ([], []))
    torch._dynamo.reset()
    model = make_model("llama")
    prompts = random_prompts([5, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=2, do_sample=False)
    generated, runner = compiled_decode(model, prompts, max_new_tokens=2)
    assert generated == expected
    assert _num_compiled(runner._compiled.block_function) == 0
    assert _num_compiled(runner._compiled.whole_forward._torchdynamo_orig_callable) == 1


def test_default_compile_falls_back_to_eager_layers_on_a_compile_error(monkeypatch, caplog):
    # compile=None (the default) turns compile on for CUDA; a model torch.compile cannot take must still run, with
    # eager layers and a warning. compile=True asked for it: the same error stands.
    from torch._dynamo.exc import Unsupported

    def failing_compile(max_seqlen_k, launch_pdl=False):
        def compiled(*args, **kwargs):
            raise Unsupported("a layer dynamo cannot trace")

        return compiled

    monkeypatch.setattr(custom_ops, "compile_step_forward", failing_compile)
    model = make_model("llama")
    prompts = random_prompts([5, 9, 3], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, async_scheduling=False, compile_cache_dir="")
    runner = hfpaged.Engine(model).core.runner
    assert runner.config.compile is None and runner.compile is False  # the default on the CPU: nothing compiled
    runner.compile = True  # what the default resolves to on CUDA
    generated, _ = _decode_with(model, runner, prompts, max_new_tokens=4)
    assert generated == expected
    assert runner.compile is False and runner._compiled is None
    assert "torch.compile failed (Unsupported" in caplog.text
    hfpaged.unpatch(model)
    compiled_model = make_model("llama")
    patch_compiled(compiled_model)
    with pytest.raises(Unsupported, match="cannot trace"):
        _decode_with(compiled_model, hfpaged.Engine(compiled_model).core.runner, prompts, max_new_tokens=4)


def _decode_with(model, runner, prompts, max_new_tokens, max_steps=None):
    """Prefill eagerly, then drive scheduler and runner through the compiled decode forward (no step may be left
    in flight); (generated ids per prompt, the runner)."""
    engine = hfpaged.Engine(model)
    for p in prompts:
        engine.add_request(p, max_new_tokens=max_new_tokens, do_sample=False)
    core = engine.core
    requests = list(core.scheduler.waiting)  # in prompt order; those whose first token ends them finish at prefill
    assert len(requests) == len(prompts)
    engine.step()  # prefill, eager
    num_steps = 0
    while core.has_unfinished() and (max_steps is None or num_steps < max_steps):
        out = core.scheduler.schedule()
        assert all(s.num_tokens == 1 for s in out.scheduled)
        runner.batch.update(out)
        host = runner.batch.pack(out.scheduled, None)
        with torch.inference_mode():
            logits = runner._graph_forward(device_views(torch.from_numpy(host.packed), host))  # the compiled forward
        tokens = logits[: host.num_sampled].argmax(-1).tolist()
        for state, token in zip(host.sample_states, tokens):
            state.append_token(token)  # what reading a StepResult does
        request_ids = [state.request_id for state in host.sample_states]
        core.scheduler.update_from_output(out, ModelRunnerOutput(request_ids, tokens))
        num_steps += 1
    return [r.output_token_ids for r in requests], runner


def test_compile_option_values():
    from hfpaged.core.config import EngineConfig

    assert EngineConfig().compile is None
    with pytest.raises(ValueError, match="compile must be True, False or None, got 'yes'"):
        EngineConfig(compile="yes")


@pytest.mark.slow
def test_forward_hooks_inside_a_layer_keep_it_out_of_the_shared_compiled_graph():
    """Identical layers share one compiled graph, and dynamo neither guards on submodule hooks nor tells layers apart
    by them: a hook on one layer's MLP registered after capture was dropped from the compiled decode steps (the H100
    gave other tokens than stock with the hook, session 30). A layer with hooks inside runs eagerly; a global module
    hook keeps every layer eager; removed, the layers share the compiled graph again."""
    model = make_model("llama", seed=3)
    prompts = random_prompts([5, 9, 3], seed=1)
    plain = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    patch_compiled(model)
    core = hfpaged.Engine(model).core
    runner = core.runner
    assert _decode_with(model, runner, prompts, 6)[0] == plain

    def scaled(module, args, output):
        return output * 1.75

    mlp = model.model.layers[0].mlp
    for local in (True, False):
        if local:
            handle = mlp.register_forward_hook(scaled)
        else:
            handle = torch.nn.modules.module.register_module_forward_hook(
                lambda m, a, out: scaled(m, a, out) if m is mlp else None
            )
        hooked = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
        assert hooked != plain
        core.check_weights(model)  # what the next call does: the hook is seen, graphs and compiled code dropped
        assert runner._compiled is None
        assert _decode_with(model, runner, prompts, 6)[0] == hooked
        if local:  # that layer alone runs eagerly
            blocks, _ = custom_ops.compile_regions(model)
            assert model.model.layers[0] not in blocks and model.model.layers[1] in blocks
        else:  # every layer eager: no compiled forward was made
            assert runner._compiled is None
        handle.remove()
        core.check_weights(model)
        assert _decode_with(model, runner, prompts, 6)[0] == plain
        assert model.model.layers[0] in custom_ops.compile_regions(model)[0]
