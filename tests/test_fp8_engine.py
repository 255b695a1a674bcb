"""FP8 KV cache in the engine: pool size and stats, where the scales come from, block moves (prefix caching,
copy-on-write, swap) on fp8 blocks, errors. CPU runs the torch reference path; `gpu` tests run Triton."""

import warnings

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.model import kv_quant

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def attention_modules(model):
    return [layer.self_attn for layer in model.model.layers]


@pytest.mark.parametrize("dtype,ratio", [(torch.float32, 4), (torch.bfloat16, 2)], ids=["fp32", "bf16"])
def test_fp8_pool_holds_more_blocks_for_the_same_memory(dtype, ratio):
    model = make_model("llama", dtype=dtype)
    hfpaged.patch(model, cpu_kv_cache_gib=0.001)
    auto = hfpaged.stats(model)
    hfpaged.patch(model, cpu_kv_cache_gib=0.001, kv_cache_dtype="fp8")
    fp8 = hfpaged.stats(model)
    assert auto["kv_cache_dtype"] == str(dtype).removeprefix("torch.") and auto["kv_cache_scale_source"] is None
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and fp8["kv_cache_scale_source"] == "calibration"
    # 2 layers x 2 KV heads x (16 + 16) dims x element size
    assert auto["kv_cache_bytes_per_token"] == 2 * 2 * 32 * dtype.itemsize and fp8["kv_cache_bytes_per_token"] == 128
    assert fp8["num_blocks"] == ratio * auto["num_blocks"]
    assert model._hfpaged.kv_caches[0][0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("setting", list(FORMATS))
def test_calibration_maps_the_first_prefill_amax_to_half_the_range(setting):
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=32, kv_cache_dtype=setting)
    state = model._hfpaged
    assert state.calibration_pending and all(s.tolist() == [1.0, 1.0] for s in state.kv_scales)
    model.generate_many(random_prompts([37], seed=4), max_new_tokens=1, do_sample=False)  # stores the prompt only
    assert not state.calibration_pending
    half_range = torch.finfo(FORMATS[setting]).max / kv_quant.CALIBRATION_MARGIN
    for (k_cache, v_cache), scales in zip(state.kv_caches, state.kv_scales):
        assert k_cache.float().abs().max() == half_range and v_cache.float().abs().max() == half_range
        assert (scales > 0).all() and (scales != 1.0).all()


def test_calibrating_on_a_short_first_step_warns_and_a_long_one_does_not():
    # the scales come from the first step that stores K/V: a warm-up of a few tokens would fix them for good
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8")
    with pytest.warns(UserWarning, match="calibrated on a step of 8 tokens"):
        model.generate_many([[5] * 8], max_new_tokens=1, do_sample=False)
    hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    with pytest.warns(UserWarning, match="calibrated on a step of 16 tokens"):  # a long prompt's first chunk
        model.generate_many(random_prompts([100], seed=2), max_new_tokens=1, do_sample=False)
    hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate_many(random_prompts([100], seed=2), max_new_tokens=2, do_sample=False)
        hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8", kv_cache_scales=0.05)  # nothing to calibrate
        model.generate_many([[5] * 8], max_new_tokens=2, do_sample=False)


def test_user_and_checkpoint_scales_are_used_as_given():
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=32, kv_cache_dtype="fp8", kv_cache_scales=[(0.25, 0.5), (0.75, 1.0)])
    assert [s.tolist() for s in model._hfpaged.kv_scales] == [[0.25, 0.5], [0.75, 1.0]]
    hfpaged.patch(model, num_blocks=32, kv_cache_dtype="fp8", kv_cache_scales=0.125)
    assert [s.tolist() for s in model._hfpaged.kv_scales] == [[0.125, 0.125]] * 2
    with pytest.raises(ValueError, match="has 1 .k_scale, v_scale. pairs but the model has 2 attention layers"):
        hfpaged.patch(model, num_blocks=32, kv_cache_dtype="fp8", kv_cache_scales=[(1.0, 1.0)])
    for i, module in enumerate(attention_modules(model)):  # as compressed-tensors attaches a checkpoint's scales
        module.k_scale = torch.nn.Parameter(torch.tensor([0.5 + i]), requires_grad=False)
        module.v_scale = torch.nn.Parameter(torch.tensor([0.25]), requires_grad=False)
    hfpaged.patch(model, num_blocks=32, kv_cache_dtype="fp8_e5m2")
    state = model._hfpaged
    assert state.kv_scale_source == "checkpoint" and not state.calibration_pending
    model.generate_many(random_prompts([9], seed=1), max_new_tokens=3, do_sample=False)
    assert [s.tolist() for s in state.kv_scales] == [[0.5, 0.25], [1.5, 0.25]]


def test_errors_name_the_setting():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"):
        hfpaged.patch(model, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_scales apply to an fp8 KV cache"):
        hfpaged.patch(model, kv_cache_scales=0.5)
    with pytest.raises(ValueError, match="kv_cache_scales must be a positive float"):
        hfpaged.patch(model, kv_cache_dtype="fp8", kv_cache_scales=[0.5, 1.0])


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100-SXM4-80GB\) has 8.0"):
        kv_quant.check_fp8_device(torch.device("cuda", 0), torch.float8_e4m3fn, "fp8")
    kv_quant.check_fp8_device(torch.device("cpu"), torch.float8_e5m2, "fp8_e5m2")  # the CPU casts fp8


def test_fp8_greedy_stays_close_to_stock_generate():
    model = make_model("llama")
    prompts = random_prompts([4, 12, 30, 50, 7, 21, 9, 16], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8")
    results = model.generate_many(prompts, max_new_tokens=8, do_sample=False)
    # This tiny random model (initializer_range 0.3) is chaotic: e4m3's ~3% error per key/value changes the
    # first token nowhere, but continuations part after 1-8 tokens (common prefixes 4,3,2,1,8,6,8,1 measured;
    # auto: all 8). The accuracy figures on a real model (SmolLM2) are in notes/fp8_kv.md.
    assert [r.token_ids[0] for r in results] == [e[0] for e in expected]
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(r.token_ids, e)) if a != b), 8) for r, e in zip(results, expected)
    ]
    assert sum(prefixes) / len(prefixes) >= 3


def _moves_equal_roomy(model, device):
    system = random_prompts([13], seed=31)[0]
    prompts = [system + p for p in random_prompts([5, 30, 12, 2, 19], seed=32)]
    kw = dict(max_new_tokens=16, do_sample=True, top_k=8, seed=5, num_return_sequences=2)  # forks: copy-on-write
    hfpaged.patch(model, num_blocks=200, block_size=4, kv_cache_dtype="fp8")
    roomy = model.generate_many(prompts, **kw)
    again = model.generate_many(prompts, **kw)  # the prompts' blocks come from the prefix cache now
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0
    # the same scales everywhere (calibration depends on the first step's batch, which the pool size changes)
    scales = [tuple(s.tolist()) for s in model._hfpaged.kv_scales]
    common = dict(block_size=4, max_num_seqs=4, kv_cache_dtype="fp8", kv_cache_scales=scales)
    hfpaged.patch(model, num_blocks=24, preemption_mode="swap", swap_space=0.01, **common)
    swapped = model.generate_many(prompts, **kw)
    assert hfpaged.stats(model)["num_swapped_out"] > 0
    hfpaged.patch(model, num_blocks=24, enable_prefix_caching=False, **common)
    recomputed = model.generate_many(prompts, **kw)
    assert hfpaged.stats(model)["num_preemptions"] > 0
    tokens = [[s.token_ids for s in r.sequences] for r in roomy]
    for other in (again, swapped, recomputed):
        assert [[s.token_ids for s in r.sequences] for r in other] == tokens


def test_prefix_cache_copy_on_write_and_swap_move_fp8_blocks_exactly():
    _moves_equal_roomy(make_model("qwen3"), "cpu")


def test_sleep_keeps_scales_and_new_weights_recalibrate():
    model = make_model("llama")
    prompts = random_prompts([20, 7], seed=8)
    hfpaged.patch(model, num_blocks=32, kv_cache_dtype="fp8")
    first = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    scales = [s.clone() for s in model._hfpaged.kv_scales]
    hfpaged.sleep(model)
    again = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert all(torch.equal(a, b) for a, b in zip(scales, model._hfpaged.kv_scales))
    with torch.no_grad():
        for module in attention_modules(model):
            module.k_proj.weight.mul_(3.0)
    model.generate_many(prompts, max_new_tokens=2, do_sample=False)
    # calibrated again on the same first prompts: layer 0's keys are 3x (its input is unchanged), its values not
    new = model._hfpaged.kv_scales[0]
    assert torch.allclose(new[0], 3.0 * scales[0][0]) and torch.equal(new[1], scales[0][1])


def test_weights_changed_while_requests_run_recalibrate_once_nothing_runs():
    model = make_model("llama")
    prompts = random_prompts([20, 7], seed=9)
    hfpaged.patch(model, num_blocks=64, kv_cache_dtype="fp8")
    state = model._hfpaged
    model.generate_many(prompts, max_new_tokens=2, do_sample=False)
    scales = [s.clone() for s in state.kv_scales]
    engine = hfpaged.Engine(model)
    engine.add_request(prompts[0], max_new_tokens=40, do_sample=False)
    engine.step()
    with torch.no_grad():
        for module in attention_modules(model):
            module.k_proj.weight.mul_(3.0)
    engine.add_request(prompts[1], max_new_tokens=2, do_sample=False)  # sees the change while one runs
    assert state.recalibrate_when_idle and not state.calibration_pending
    while engine.has_unfinished():
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(scales, state.kv_scales))  # kept while old K/V was in use
    model.generate_many(prompts, max_new_tokens=2, do_sample=False)  # idle now: calibrated on this call
    assert not state.recalibrate_when_idle and not state.calibration_pending
    assert torch.allclose(state.kv_scales[0][0], 3.0 * scales[0][0]) and torch.equal(
        state.kv_scales[0][1], scales[0][1]
    )


def test_blocks_cached_between_a_weight_change_and_the_recalibration_are_not_reused():
    """Requests that ran after the weights changed (while old K/V was still in use) stored blocks quantized with the
    old scales; the recalibration once idle must drop them too (a probe found them hit and read with the new
    scales: K off by the change's factor, other tokens than recomputing)."""
    model = make_model("llama", seed=0)
    hfpaged.patch(model, num_blocks=128, block_size=4, kv_cache_dtype="fp8")
    first, running, shared = random_prompts([80, 10, 64], seed=4)
    model.generate_many([first], max_new_tokens=1, do_sample=False)  # calibrates
    engine = hfpaged.Engine(model)
    engine.add_request(running, max_new_tokens=60, do_sample=False)
    engine.step()
    with torch.no_grad():
        for module in attention_modules(model):
            module.k_proj.weight.mul_(3.0)
            module.v_proj.weight.mul_(3.0)
    engine.add_request(shared, max_new_tokens=2, do_sample=False)  # runs to the end: its prompt blocks are cached
    while engine.has_unfinished():
        engine.step()
    extended = [shared + [7, 8, 9]]
    got = model.generate_many(extended, max_new_tokens=12, do_sample=False)[0].token_ids  # recalibrates
    hfpaged.patch(model, num_blocks=128, block_size=4, kv_cache_dtype="fp8", max_num_seqs=8)  # fresh, same scales
    assert got == model.generate_many(extended, max_new_tokens=12, do_sample=False)[0].token_ids


# ---- GPU: Triton kernels, CUDA graphs, compile, memory-sized pool ---------------------------------------


@pytest.mark.gpu
def test_gpu_fp8_pool_is_twice_the_bf16_pool():
    # a long max_position so that memory, not max_num_seqs x the model's length, bounds the pool
    model = make_model("llama", dtype=torch.bfloat16, max_position_embeddings=1 << 20).cuda()
    hfpaged.patch(model, gpu_memory_utilization=0.1)
    auto = hfpaged.stats(model)["num_blocks"]
    hfpaged.patch(model, gpu_memory_utilization=0.1, kv_cache_dtype="fp8")
    assert 1.95 <= hfpaged.stats(model)["num_blocks"] / auto <= 2.05


@pytest.mark.gpu
@pytest.mark.parametrize("setting", list(FORMATS))
def test_gpu_fp8_graphs_eager_and_compile(setting):
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    prompts = random_prompts([4, 12, 30, 50, 7, 21, 9, 16], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    runs = {}
    # graphs of eager layers against eager steps: the same kernels, exact; compiled layers (the default on CUDA)
    # fuse the norms and RoPE in another order, so their bf16 tokens are held to the yardstick below
    modes = [("eager", dict(enforce_eager=True)), ("graphs", dict(compile=False))]
    modes += [("compile", {})] if setting == "fp8" else []  # one compile: it takes a minute
    for name, options in modes:
        hfpaged.patch(model, num_blocks=128, block_size=16, kv_cache_dtype=setting, **options)
        assert model._hfpaged.use_triton
        runs[name] = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=16, do_sample=False)]
        assert (model._hfpaged.engine.runner.num_graph_steps > 0) == (name != "eager")
    assert runs["graphs"] == runs["eager"]  # the same kernels read the same fp8 blocks
    for name, tokens in runs.items():
        first = sum(t[0] == e[0] for t, e in zip(tokens, expected))
        print(f"{setting} {name}: first token equal to stock bf16 generate for {first}/{len(prompts)}")
        assert first >= len(prompts) - 2


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["auto", "fp8"])
def test_gpu_graphs_of_a_long_context_model_capture_without_a_retry(setting):
    # the graphs bake the model's whole length as the key hint: their decode batches may split their context more
    # ways than the warm-up's (4,096-key) batches, so a merge variant (with fp8, also that of a mixed step's decode
    # rows) may first compile inside a capture; no capture may fail for it (session 34, H200: none did, with a
    # warm-up that compiled those variants ahead and with one that does not, kept as the cheaper)
    model = make_model("llama", dtype=torch.bfloat16, max_position_embeddings=40960).cuda()
    prompts = random_prompts([4, 12, 30, 50, 7, 21, 9, 16], seed=3)
    hfpaged.patch(model, num_blocks=4096, block_size=16, kv_cache_dtype=setting, compile=False, max_num_seqs=16)
    runner = model._hfpaged.engine.runner
    engine, ids = hfpaged.Engine(model), []
    for step in range(200):  # prompts joining running ones: mixed steps with decode rows
        if prompts and step % 3 == 0:
            ids.append(engine.add_request(prompts.pop(0), max_new_tokens=12, do_sample=False))
        engine.step()
        if not prompts and not engine.has_unfinished():
            break
    assert runner.graphs is not None and runner.mixed_graphs is not None and runner.num_graph_steps > 0
    assert runner.graphs.capture_retries == 0 and runner.mixed_graphs.capture_retries == 0


@pytest.mark.gpu
def test_gpu_fp8_block_moves_are_exact():
    _moves_equal_roomy(make_model("qwen3").cuda(), "cuda")
