"""Architectures beyond the core list (``tests/models.py``'s ``MORE_ARCHS``): greedy tokens equal stock
``generate`` on the CPU, and on CUDA with the default options (Triton kernels, compiled layers, CUDA graphs,
fused projections), under chunked prefill and preemption."""

from __future__ import annotations

import pytest
from models import MORE_ARCHS, make_more_model, random_prompts, reference_generate

import hfpaged

LENGTHS = [1, 5, 13, 30, 9]
POOL = dict(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)


def check_parity(model) -> None:
    prompts = random_prompts(LENGTHS, seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2  # the continuations vary
    hfpaged.patch(model, **POOL)
    assert model._hfpaged.length_limit is None
    results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in results] == expected
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("arch", list(MORE_ARCHS))
def test_more_architectures_are_token_exact(arch):
    check_parity(make_more_model(arch))


# In float32, transformers' MoE experts take a fallback that copies host data (no grouped_mm for float32 under
# torch.compile): the graph capture fails and these steps run eagerly (exact either way; H100, session 27).
EAGER_IN_FLOAT32 = {"mixtral", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe_swa"}
# Query/key heads wider than value heads (MLA: 24 vs 16; MiMo-V2-Flash: 16 vs its v_head_dim); the Triton kernels
# need one head size, so the torch attention runs.
TORCH_ATTENTION = {"deepseek_v3", "mimo_v2_flash"}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(MORE_ARCHS))
def test_more_architectures_are_token_exact_on_cuda_with_default_options(arch):
    model = make_more_model(arch).cuda()
    check_parity(model)
    state = model._hfpaged
    assert state.use_triton == (arch not in TORCH_ATTENTION)
    graphs = state.use_triton and arch not in EAGER_IN_FLOAT32
    assert (state.engine.runner.num_graph_steps > 0) == graphs
