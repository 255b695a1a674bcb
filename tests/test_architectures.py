"""Architectures beyond the core list (``tests/models.py``'s ``MORE_ARCHS``): greedy tokens equal stock
``generate`` on the CPU, and on CUDA with the default options (Triton kernels, compiled layers, CUDA graphs,
fused projections), under chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from models import MORE_ARCHS, check_callers_and_changed_weights, make_more_model, random_prompts, reference_generate

import hfpaged

LENGTHS = [1, 5, 13, 30, 9]
POOL = dict(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)


def check_parity(model, **options) -> None:
    prompts = random_prompts(LENGTHS, seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2  # the continuations vary
    hfpaged.patch(model, **POOL, **options)
    assert model._hfpaged.length_limit is None
    results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
    assert [r.token_ids for r in results] == expected
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("arch", list(MORE_ARCHS))
def test_more_architectures_are_token_exact(arch):
    check_parity(make_more_model(arch))


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest only without CUDA); on CUDA "
    "test_mla_heads_replay_from_cuda_graphs runs MLA heads through the Triton kernels",
)
def test_value_heads_of_another_size_are_token_exact_through_the_triton_kernels():
    # DeepSeek-V3's MLA: query/key heads of 24, value heads of 16 here. The Triton kernels size them apart
    # (tests/test_kernels.py); on the CPU they run interpreted (MiMo-V2-Flash's 16 / 128 runs on the GPU below).
    # Swap preemption, three callers, then weights changed in place between calls.
    model = make_more_model("deepseek_v3")
    prompts = random_prompts(LENGTHS, seed=3)
    settings = dict(max_new_tokens=8, do_sample=False)
    expected = reference_generate(model, prompts, **settings)
    assert sum(len(set(e)) > 3 for e in expected) >= len(expected) // 2  # the continuations vary
    hfpaged.patch(model, **POOL, preemption_mode="swap", swap_space=0.01, attention_backend="triton")
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == expected
    assert hfpaged.stats(model)["num_swapped_out"] > 0
    check_callers_and_changed_weights(model, prompts, expected, **settings)


# In float32, transformers' MoE experts take a fallback that copies host data (no grouped_mm for float32 under
# torch.compile): the graph capture fails and these steps run eagerly (exact either way; H100, sessions 27-28).
EAGER_IN_FLOAT32 = {"mixtral", "qwen3_moe", "olmoe", "gpt_oss", "granitemoe_swa", "deepseek_v3", "mimo_v2_flash"}


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(MORE_ARCHS))
def test_more_architectures_are_token_exact_on_cuda_with_default_options(arch):
    model = make_more_model(arch).cuda()
    check_parity(model)
    state = model._hfpaged
    assert state.use_triton
    assert (state.engine.runner.num_graph_steps > 0) == (arch not in EAGER_IN_FLOAT32)


@pytest.mark.gpu
def test_mla_heads_replay_from_cuda_graphs():
    # DeepSeek-V3 with dense MLPs only (no float32 MoE fallback): MLA's value heads through the graphs and the
    # compiled layers' custom op
    model = make_more_model("deepseek_v3", first_k_dense_replace=2).cuda()
    check_parity(model)
    assert model._hfpaged.use_triton and model._hfpaged.engine.runner.num_graph_steps > 0
