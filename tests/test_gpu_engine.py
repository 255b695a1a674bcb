"""Engine on CUDA: Triton kernels, with and without CUDA graphs (run with `pytest -m gpu` on a GPU)."""

import pytest
import torch
from models import ARCHS, make_model, random_prompts, reference_generate

import hfpaged

pytestmark = pytest.mark.gpu

LENGTHS = [1, 3, 9, 17, 33, 64, 5, 40]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_float32_parity_triton(arch, enforce_eager):
    model = make_model(arch).cuda()
    prompts = random_prompts(LENGTHS, seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=24, do_sample=False)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2
    hfpaged.patch(
        model, num_blocks=26, block_size=4, max_num_seqs=3, max_num_batched_tokens=24, enforce_eager=enforce_eager
    )
    assert model._hfpaged.use_triton
    results = model.generate_many(prompts, max_new_tokens=24, do_sample=False)
    assert [r.token_ids for r in results] == expected
    runner = model._hfpaged.engine.runner
    if enforce_eager:
        assert runner.num_graph_steps == 0
    else:
        assert runner.num_graph_steps > 0
    st = hfpaged.stats(model)
    assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_blocks"]


def test_graph_replay_equals_eager_logits():
    model = make_model("qwen3").cuda()
    prompts = random_prompts([5, 9, 13], seed=2)
    hfpaged.patch(model, num_blocks=64, block_size=8)
    eager = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=8, enforce_eager=True)
    graphs = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in eager] == [r.token_ids for r in graphs]


def test_bf16_first_32_tokens_mostly_match():
    model = make_model("llama", dtype=torch.bfloat16).cuda()
    prompts = random_prompts([4, 12, 30, 50, 7, 21, 9, 16], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=32, do_sample=False)
    hfpaged.patch(model, num_blocks=128, block_size=16)
    results = model.generate_many(prompts, max_new_tokens=32, do_sample=False)
    share = sum(r.token_ids == e for r, e in zip(results, expected)) / len(prompts)
    print(f"bf16: {share:.0%} of prompts match stock generate on all 32 tokens")
    assert sum(r.token_ids[0] == e[0] for r, e in zip(results, expected)) >= len(prompts) - 1


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_compiled_graphs_parity(arch):
    model = make_model(arch).cuda()
    prompts = random_prompts(LENGTHS, seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8, compile=True)
    results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert model._hfpaged.engine.runner.num_graph_steps > 0 and model._hfpaged.engine.runner._compiled is not None


def test_device_map_layers_on_two_devices_keep_their_kv_there():
    """Layer 0 on the CPU, the rest on the GPU (accelerate-style placement): K/V live with each layer."""
    model = make_model("llama")
    prompts = random_prompts([5, 20, 9], seed=6)
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    model.model.layers[1].cuda()
    model.model.norm.cuda()
    model.lm_head.cuda()
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(
        model.model.layers[1], AlignDevicesHook(execution_device=torch.device("cuda:0"), io_same_device=False)
    )
    add_hook_to_module(
        model.model.norm, AlignDevicesHook(execution_device=torch.device("cuda:0"), io_same_device=False)
    )
    add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device=torch.device("cuda:0"), io_same_device=False))
    hfpaged.patch(model, num_blocks=32, block_size=4)
    caches = model._hfpaged.kv_caches
    assert caches[0][0].device.type == "cpu" and caches[1][0].device.type == "cuda"
    results = model.generate_many(prompts, max_new_tokens=10, do_sample=False)
    assert [r.token_ids for r in results] == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_over_two_gpus_keeps_kv_with_each_layer_and_stays_exact():
    """accelerate's dispatch_model (what from_pretrained(device_map=...) does) over cuda:0 and cuda:1."""
    from accelerate import dispatch_model

    model = make_model("qwen3")
    prompts = random_prompts(LENGTHS, seed=7)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    model = dispatch_model(model, device_map=device_map)
    hfpaged.patch(model, num_blocks=26, block_size=4, max_num_seqs=3, max_num_batched_tokens=24)
    caches = model._hfpaged.kv_caches
    assert caches[0][0].device == torch.device("cuda:0") and caches[1][0].device == torch.device("cuda:1")
    results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in results] == expected
    st = hfpaged.stats(model)
    assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_blocks"]
