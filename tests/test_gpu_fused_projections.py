"""Fused q/k/v and gate/up projections on CUDA (the default, fuse_projections=None: on for CUDA layers): float32 parity through the CUDA graphs
(compiled too), and no second copy of the weights (run with `pytest -m gpu` on a GPU)."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

pytestmark = pytest.mark.gpu

LENGTHS = [1, 3, 9, 17, 33, 64, 5, 40]


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma2"])
def test_cuda_float32_parity_fused(arch, compile):
    if compile and arch in ("mistral", "qwen2"):
        pytest.skip("one compiled run per attention flavour is enough (llama, qwen3, gemma2)")
    model = make_model(arch).cuda()
    prompts = random_prompts(LENGTHS, seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=24, do_sample=False)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2
    hfpaged.patch(model, num_blocks=26, block_size=4, max_num_seqs=3, max_num_batched_tokens=24, compile=compile,
                  fuse_projections=None)  # fmt: skip
    assert len(model._hfpaged.fused_projections.groups) == 2 * model.config.num_hidden_layers  # None: on for CUDA
    results = model.generate_many(prompts, max_new_tokens=24, do_sample=False)
    assert [r.token_ids for r in results] == expected
    assert model._hfpaged.engine.runner.num_graph_steps > 0
    assert len(model._hfpaged.fused_projections.groups) == 2 * model.config.num_hidden_layers


def test_cuda_fusion_on_by_default_and_off_by_option():
    model = make_model("llama").cuda()
    hfpaged.patch(model, num_blocks=26, block_size=4)
    assert len(model._hfpaged.fused_projections.groups) == 2 * model.config.num_hidden_layers
    hfpaged.unpatch(model)
    hfpaged.patch(model, num_blocks=26, block_size=4, fuse_projections=False)
    assert model._hfpaged.fused_projections.groups == []


def test_gpu_memory_after_patch_within_one_percent_excluding_the_pool():
    model = make_model(
        "llama", dtype=torch.bfloat16, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, vocab_size=4096
    ).cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    hfpaged.patch(model, num_blocks=64, block_size=16, fuse_projections=True)
    assert len(model._hfpaged.fused_projections.groups) == 16
    pool = sum(k.nbytes + v.nbytes for k, v in model._hfpaged.kv_caches)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - pool
    print(f"allocated before patch {before / 2**20:.1f} MiB, after (pool excluded) {after / 2**20:.1f} MiB")
    assert abs(after - before) <= 0.01 * before
    hfpaged.unpatch(model)
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - before) <= 0.01 * before
