"""Swap preemption: blocks move to CPU swap space and back; outputs identical to recompute."""

import pytest
from models import make_model, random_prompts, reference_generate
from test_scheduler import blocks, params, update

import hfpaged
from hfpaged.core.config import EngineConfig
from hfpaged.core.kv_manager import KVManager
from hfpaged.core.request import Request, RequestStatus
from hfpaged.core.scheduler import Scheduler


def make(num_blocks=4, cpu_blocks=8):
    config = EngineConfig(
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=100,
        watermark=0.0,
        enable_prefix_caching=False,
        preemption_mode="swap",
    )
    return Scheduler(config, KVManager(num_blocks, 4, enable_prefix_caching=False, num_cpu_blocks=cpu_blocks))


def plan(out):
    return [(s.request_id, s.start, s.num_tokens) for s in out.scheduled]


def test_swap_out_keeps_progress_and_swap_in_resumes_decoding():
    s = make()
    a, b = Request("a", list(range(3, 11)), params()), Request("b", list(range(20, 28)), params())
    s.add(a)
    s.add(b)
    out = s.schedule()
    update(s, out, {"a": 7, "b": 8})
    b_blocks = list(blocks(s, b))
    out = s.schedule()  # a needs a third block: b is swapped out, not recomputed
    assert out.swap_out == [(b_blocks, [0, 1])]
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8 and s.kv.cpu_block_ids(b) == [0, 1]
    assert list(s.swapped) == [b] and not s.waiting
    assert s.counters["num_swapped_out"] == 1 and s.counters["num_preemptions"] == 1
    update(s, out, {"a": 9})
    s.finish(a, "stop")
    out = s.schedule()
    assert plan(out) == [("b", 8, 1)]  # only its decode token: its KV comes back from swap space
    assert out.swap_in == [([0, 1], blocks(s, b)[:2])]
    assert len(blocks(s, b)) == 3 and s.kv.cpu_block_ids(b) == [] and s.kv.cpu_pool.all_free()
    update(s, out, {"b": 1})
    s.finish(b, "stop")
    assert s.kv.all_free()


def test_full_swap_space_falls_back_to_recompute():
    s = make(cpu_blocks=1)
    a, b = Request("a", list(range(3, 11)), params()), Request("b", list(range(20, 28)), params())
    s.add(a)
    s.add(b)
    update(s, s.schedule(), {"a": 7, "b": 8})
    out = s.schedule()
    assert out.swap_out == [] and out.preempted_ids == ["b"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.counters["num_swapped_out"] == 0


def test_aborting_a_swapped_request_frees_its_cpu_blocks():
    s = make()
    a, b = Request("a", list(range(3, 11)), params()), Request("b", list(range(20, 28)), params())
    s.add(a)
    s.add(b)
    update(s, s.schedule(), {"a": 7, "b": 8})
    s.schedule()
    assert b.status is RequestStatus.SWAPPED
    s.finish(b, "abort")
    assert s.kv.cpu_pool.all_free() and not s.swapped


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gemma2"])
def test_swap_and_recompute_give_identical_outputs_under_a_tiny_pool(arch):
    model = make_model(arch)
    prompts = random_prompts([5, 30, 12, 44, 3, 21, 9], seed=30)
    expected = reference_generate(model, prompts, max_new_tokens=20, do_sample=False)
    for mode in ("swap", "recompute"):
        hfpaged.patch(
            model,
            num_blocks=30,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            preemption_mode=mode,
            swap_space=0.01,
            enable_prefix_caching=False,
        )
        results = model.generate_many(prompts, max_new_tokens=20, do_sample=False)
        assert [r.token_ids for r in results] == expected, mode
        st = hfpaged.stats(model)
        assert st["num_preemptions"] > 0
        assert (st["num_swapped_out"] > 0) == (mode == "swap")
        assert st["num_free_blocks"] == st["num_blocks"]
        assert st["num_free_cpu_blocks"] == st["num_cpu_blocks"]


def test_swap_with_prefix_caching_and_sampling_is_exact():
    model = make_model("qwen3")
    system = random_prompts([13], seed=31)[0]
    prompts = [system + p for p in random_prompts([5, 30, 12, 2, 19], seed=32)]
    kw = dict(max_new_tokens=16, do_sample=True, top_k=8, seed=5)
    hfpaged.patch(model, num_blocks=200, block_size=4)
    roomy = model.generate_many(prompts, **kw)
    hfpaged.patch(model, num_blocks=24, block_size=4, max_num_seqs=4, preemption_mode="swap", swap_space=0.01)
    tight = model.generate_many(prompts, **kw)
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    assert hfpaged.stats(model)["num_swapped_out"] > 0
