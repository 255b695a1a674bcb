"""Prefix caching: hash chaining, hits at admission, LRU eviction, and unchanged outputs."""

import pytest
from models import make_model, random_prompts, reference_generate
from test_scheduler import blocks, params, update

import hfpaged
from hfpaged.core.block_pool import BlockPool
from hfpaged.core.config import EngineConfig
from hfpaged.core.kv_manager import KVManager
from hfpaged.core.prefix_cache import PrefixCache
from hfpaged.core.request import Request
from hfpaged.core.scheduler import Scheduler


def req(rid, tokens):
    return Request(rid, list(tokens), params())


def test_block_hashes_are_chained_through_the_parent():
    cache = PrefixCache(BlockPool(4), block_size=2)
    a = [5, 6, 7, 8, 9]
    hashes_a = cache.extend_hashes(a, [])
    ha, hb, hc = list(hashes_a), cache.extend_hashes([5, 6, 1, 1], []), cache.extend_hashes([1, 1, 7, 8], [])
    assert len(ha) == 2 and len(hb) == 2  # only full blocks are hashed
    assert ha[0] == hb[0]  # same first block
    assert ha[1] != hb[1]
    assert ha[1] != hc[1]  # same tokens [7, 8] but a different parent
    a.append(10)
    assert cache.extend_hashes(a, hashes_a)[:2] == ha and len(hashes_a) == 3


def make_scheduler(num_blocks=16, block_size=4, caching=True):
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=64,
        watermark=0.0,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, KVManager(num_blocks, block_size, enable_prefix_caching=caching))


def run_to_end(s, token=50):
    while s.has_unfinished():
        out = s.schedule()
        update(s, out, {x.request_id: token for x in out.scheduled if x.samples})


def test_a_later_request_reuses_computed_prefix_blocks_and_counts_hits():
    s = make_scheduler()
    a = req("a", range(3, 23))  # 20 tokens: 5 full blocks
    a.params.max_length = 22
    s.add(a)
    run_to_end(s)
    a_blocks = list(range(6))  # a held blocks 0..5 (20 prompt + 1 generated token in KV)
    assert s.kv.pool.all_free()
    b = req("b", list(range(3, 23)) + [90, 91, 92, 93])  # 24 tokens: 5 cached blocks usable
    s.add(b)
    out = s.schedule()
    assert [(x.start, x.num_tokens) for x in out.scheduled] == [(20, 4)]
    assert blocks(s, b)[:5] == a_blocks[:5]
    assert all(s.kv.pool.ref_counts[i] == 1 for i in blocks(s, b))
    assert s.counters["prefix_cache_queries"] == 20 + 24
    assert s.counters["prefix_cache_hits"] == 20


def test_a_fully_cached_prompt_still_computes_its_last_block():
    s = make_scheduler()
    a = req("a", range(3, 23))
    a.params.max_length = 21
    s.add(a)
    run_to_end(s)
    b = req("b", range(3, 23))  # the same 20 tokens
    s.add(b)
    out = s.schedule()
    # at most num_tokens - 1 = 19 tokens may come from the cache: 4 whole blocks
    assert [(x.start, x.num_tokens, x.samples) for x in out.scheduled] == [(16, 4, True)]
    assert s.counters["prefix_cache_hits"] == 16


def test_running_requests_share_blocks_by_ref_count():
    s = make_scheduler(num_blocks=20)
    a = req("a", range(3, 15))  # 12 tokens: 3 blocks
    s.add(a)
    update(s, s.schedule(), {"a": 50})  # prefill done, blocks registered, a still running
    b = req("b", list(range(3, 15)) + [7])
    s.add(b)
    s.schedule()
    assert blocks(s, b)[:3] == blocks(s, a)[:3]
    assert [s.kv.pool.ref_counts[i] for i in blocks(s, a)[:3]] == [2, 2, 2]
    s.finish(a, "stop")
    assert [s.kv.pool.ref_counts[i] for i in blocks(s, b)[:3]] == [1, 1, 1]
    s.finish(b, "stop")
    assert s.kv.pool.all_free()


def test_cached_blocks_are_evicted_oldest_first_when_the_pool_needs_them():
    s = make_scheduler(num_blocks=6, block_size=2)
    a = req("a", [3, 4, 5, 6])  # 2 blocks
    a.params.max_length = 5
    s.add(a)
    run_to_end(s)  # a's 2 full prompt blocks stay cached, free
    c = req("c", [7, 8, 9, 10])
    c.params.max_length = 5
    s.add(c)
    run_to_end(s)
    assert s.kv.pool.num_free_blocks == 6
    # free queue now: uncached 4, 5, then a's blocks (released first, tail first: 1, 0), then c's (3, 2)
    big = req("big", range(20, 30))  # 10 tokens = 5 blocks
    s.add(big)
    s.schedule()
    assert blocks(s, big) == [4, 5, 1, 0, 3]
    assert s.kv.lookup_prefix(req("a2", [3, 4, 5, 6, 1])) == []
    assert s.kv.lookup_prefix(req("c2", [7, 8, 9, 10, 1])) == [2]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2"])
def test_outputs_never_change_with_cache_hits_within_and_across_calls(arch):
    model = make_model(arch)
    system = random_prompts([21], seed=20)[0]
    questions = random_prompts([1, 4, 9, 3, 12, 6], seed=21)
    prompts = [system + q for q in questions] + [system, system[:8]]
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=3, max_num_batched_tokens=24)
    first = model.generate_many(prompts, max_new_tokens=10, do_sample=False)
    assert [r.token_ids for r in first] == expected
    st = hfpaged.stats(model)
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_blocks"] == st["num_blocks"]  # cached blocks count as free
    again = model.generate_many(prompts[::-1], max_new_tokens=10, do_sample=False)
    assert [r.token_ids for r in again] == expected[::-1]
    st2 = hfpaged.stats(model)
    assert st2["prefix_cache_hits"] - st["prefix_cache_hits"] >= 20 * len(prompts) // 2
    hfpaged.patch(
        model, num_blocks=40, block_size=4, max_num_seqs=3, max_num_batched_tokens=24, enable_prefix_caching=False
    )
    off = model.generate_many(prompts, max_new_tokens=10, do_sample=False)
    assert [r.token_ids for r in off] == expected
    assert hfpaged.stats(model)["prefix_cache_hits"] == 0


def test_requests_holding_kv_at_a_reset_never_publish_their_blocks():
    """After reset_prefix_cache (the weights changed), a request that holds K/V computed before it (on the GPU,
    swapped out, or inherited by a fork or a beam) publishes no block: later blocks attend over the old K/V."""
    kv = KVManager(32, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    running, swapped, fresh = req("running", range(3, 15)), req("swapped", range(30, 42)), req("fresh", range(60, 72))
    for r in (running, swapped):
        assert kv.allocate(r, 12, prefix_hits=[])
        r.num_computed_tokens = 12
    assert kv.swap_out(swapped) is not None
    kv.reset_prefix_cache()
    child, beam = req("child", range(3, 15)), req("beam", range(80, 92))
    kv.fork(child, running)
    assert kv.allocate(beam, 12, prefix_hits=[])
    kv.share([beam], [running])
    kv.swap_in(swapped, 12)
    assert kv.allocate(fresh, 12, prefix_hits=[])
    for r in (running, swapped, child, beam, fresh):
        r.num_computed_tokens = 12
        kv.register_computed(r)
    assert kv.lookup_prefix(req("again", range(3, 16))) == []  # running's (and its fork's, beam's) blocks
    assert kv.lookup_prefix(req("again2", range(30, 43))) == []  # swapped out across the reset
    assert len(kv.lookup_prefix(req("again3", range(60, 73)))) == 3  # computed after the reset: published
    kv.free(running, keep_hashes=True)  # preempted to be recomputed: with the new weights, publishable again
    assert kv.allocate(running, 12, prefix_hits=[])
    kv.register_computed(running)
    assert len(kv.lookup_prefix(req("again4", range(3, 16)))) == 3
