"""Programmatic dependent launch settings (the kernels' GPU behaviour: test_kernels.py and test_gpu_graphs.py)."""

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.core.config import EngineConfig
from hfpaged.kernels.dependent_launch import dependent_launch_supported, launch_options
from hfpaged.model.custom_ops import inductor_options
from hfpaged.model.gemv_fusion import GemvFusionPass


def test_setting_values_are_checked():
    assert EngineConfig().dependent_launch is None
    with pytest.raises(ValueError, match="dependent_launch must be True, False or None, got 'yes'"):
        EngineConfig(dependent_launch="yes")


def test_not_supported_off_cuda():
    assert not dependent_launch_supported(torch.device("cpu"))
    assert launch_options(False) == {} and launch_options(True) == {"launch_pdl": True}
    combo = {"combo_kernels": True} if hasattr(torch._inductor.config, "combo_kernels") else {}
    has_pdl = hasattr(torch._inductor.config.triton, "enable_pdl")
    for pdl, expected in ((False, combo), (True, {**combo, "triton.enable_pdl": True} if has_pdl else combo)):
        options = inductor_options(pdl)
        fusion = options.pop("post_grad_custom_post_pass")  # the GEMV's neighbours (gemv_fusion.py)
        assert options == expected and isinstance(fusion, GemvFusionPass)


def test_kernels_refuse_launch_pdl_where_unsupported():
    from hfpaged.kernels import paged_attention, store_kv

    cache = torch.zeros(4, 4, 1, 16)
    key = torch.ones(2, 1, 16)
    slots = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="launch_pdl=True needs a CUDA GPU of compute capability 9.0.*interpreter"):
        store_kv(key, key, cache, cache.clone(), slots, launch_pdl=True)
    assert cache.abs().sum() == 0  # nothing written
    tables, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="launch_pdl=True needs a CUDA GPU"):
        paged_attention(torch.ones(2, 2, 16), cache, cache, tables, lens, cu, scale=0.25, launch_pdl=True)
    store_kv(key, key, cache, cache.clone(), slots)  # the same calls without it run
    out = paged_attention(torch.ones(2, 2, 16), cache, cache, tables, lens, cu, scale=0.25)
    assert out.shape == (2, 2, 16) and not out.isnan().any()


def test_default_is_off_where_unsupported_and_generation_is_exact():
    model = make_model("llama")
    prompts = random_prompts([5, 12, 3], seed=3)
    hfpaged.patch(model, num_blocks=32, block_size=4, attention_backend="triton")
    state = model._hfpaged
    assert state.dependent_launch is False
    assert state.attention_function().keywords == {"launch_pdl": False}
    results = model.generate_many(prompts, max_new_tokens=6, do_sample=False)
    assert [r.token_ids for r in results] == reference_generate(model, prompts, max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_required_where_unsupported_is_a_clear_error(backend):
    model = make_model("llama")
    prompts = random_prompts([4, 9], seed=4)
    expected = reference_generate(model, prompts, max_new_tokens=5, do_sample=False)
    pattern = (
        "dependent_launch=True needs a CUDA GPU of compute capability 9.0"
        if backend == "triton"
        else "attention_backend='torch'"
    )
    with pytest.raises(ValueError, match=pattern):
        hfpaged.patch(model, num_blocks=32, block_size=4, attention_backend=backend, dependent_launch=True)
    assert getattr(model, "_hfpaged", None) is None  # nothing attached
    assert reference_generate(model, prompts, max_new_tokens=5, do_sample=False) == expected
    hfpaged.patch(model, num_blocks=32, block_size=4, attention_backend=backend)  # still patchable
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=5, do_sample=False)] == expected


def test_default_policy_where_supported(monkeypatch):
    # as on a Hopper GPU: the default turns it on, except for a tensor-parallel model (not yet run on two GPUs with
    # it), where True still turns it on; False is off everywhere
    from hfpaged.kernels import dependent_launch

    monkeypatch.setattr(dependent_launch, "dependent_launch_supported", lambda device: True)
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=32, block_size=4, attention_backend="triton")
    state = model._hfpaged
    assert state.dependent_launch is True
    assert state.attention_function().keywords == {"launch_pdl": True}
    state.tp = object()  # what a model sharded by transformers' tp_plan has
    assert state.dependent_launch is False
    monkeypatch.setattr(state.config, "dependent_launch", True)
    assert state.dependent_launch is True
    monkeypatch.setattr(state.config, "dependent_launch", False)
    state.tp = None
    assert state.dependent_launch is False
    hfpaged.unpatch(model)
