"""Sequences sharing blocks: ref counts through fork, copy-on-write of the last block, beams taking over
their parents' block tables, copies cancelled by preemption, and beam groups admitted and preempted as
a whole (exact expectations)."""

import pytest

from hfpaged.block_pool import BlockPool
from hfpaged.config import EngineConfig
from hfpaged.parallel_sampling import sample_seed
from hfpaged.request import Request, RequestStatus
from hfpaged.scheduler import Scheduler
from test_scheduler import params


def make(num_blocks=16, budget=100, mode="recompute", max_num_seqs=8):
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                          watermark=0.0, enable_prefix_caching=False, preemption_mode=mode)
    return Scheduler(config, BlockPool(num_blocks), counters={}, cpu_pool=BlockPool(8) if mode == "swap" else None)


def prefilled(s, rid="p", n=6, token=50):
    """A request whose n-token prompt is computed and which has sampled its first token."""
    r = Request(rid, list(range(3, 3 + n)), params())
    s.add(r)
    s.update(s.schedule(), {rid: token})
    return r


def forked(s, parent, rid="p.1", token=60):
    child = Request(rid, parent.prompt_token_ids, params())
    s.fork(child, parent)
    child.append_token(token)
    return child


def plan(out):
    return [(x.request.request_id, x.start, x.num_tokens) for x in out.scheduled]


def test_fork_shares_every_block_and_the_last_one_is_copied_on_first_write():
    s = make()
    parent = prefilled(s, n=6)  # blocks [0, 1]: one full block, one holding 2 of 4 slots
    child = forked(s, parent)
    assert child.block_ids == [0, 1] and child.num_computed_tokens == 6 and child.status is RequestStatus.RUNNING
    assert s.running == [parent, child]
    assert s.pool.ref_counts[:3] == [2, 2, 0]
    out = s.schedule()
    assert plan(out) == [("p", 6, 1), ("p.1", 6, 1)]
    # the parent writes first: it copies the shared block 1 into block 2; the child then owns block 1 alone
    assert out.block_copies == [(1, 2)]
    assert parent.block_ids == [0, 2] and child.block_ids == [0, 1]
    assert s.pool.ref_counts[:4] == [2, 1, 1, 0]
    s.update(out, {"p": 51, "p.1": 61})
    s.finish(child, "stop")
    assert s.pool.ref_counts[:3] == [1, 0, 1]
    s.finish(parent, "stop")
    assert s.pool.all_free()


def test_a_fork_at_a_block_boundary_needs_no_copy():
    s = make()
    parent = prefilled(s, n=8)
    forked(s, parent)
    out = s.schedule()
    assert out.block_copies == []
    assert [r.block_ids for r in s.running] == [[0, 1, 2], [0, 1, 3]]
    assert s.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_update_forks_children_with_their_own_tokens_and_stop_checks():
    s = make()
    parent = Request("p", list(range(3, 9)), params(eos=(99,)))
    s.add(parent)
    out = s.schedule()
    children = [Request(f"p.{i}", parent.prompt_token_ids, params(eos=(99,))) for i in (1, 2)]
    advanced = s.update(out, {"p": 50, "p.1": 99, "p.2": 52}, forks={"p": children})
    assert advanced == [parent, *children]
    assert [r.output_token_ids for r in advanced] == [[50], [99], [52]]
    assert children[0].finish_reason == "stop" and children[0].block_ids == []  # eos at once: released
    assert s.running == [parent, children[1]]
    assert s.pool.ref_counts[:3] == [2, 2, 0]


def test_share_blocks_moves_beams_onto_their_parents_tables_and_frees_the_rest():
    s = make()
    a = prefilled(s, "a", n=6)
    b = forked(s, a, "b", token=70)
    s.update(s.schedule(), {})  # both compute their token; a copies the shared block 1 -> 2 first
    assert a.block_ids == [0, 2] and b.block_ids == [0, 1] and a.num_computed_tokens == b.num_computed_tokens == 7
    # the selection continues a twice and b not at all: b's own block 1 goes back to the pool
    s.share_blocks([a, b], [a, a])
    assert a.block_ids == b.block_ids == [0, 2] and b.num_computed_tokens == 7
    assert s.pool.ref_counts[:3] == [2, 0, 2] and s.pool.num_free_blocks == 14
    # a selection that swaps them around keeps every count
    s.share_blocks([a, b], [b, a])
    assert s.pool.ref_counts[:3] == [2, 0, 2]
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.pool.all_free()


def idle_sharer_and_writer(s):
    """``a`` has computed everything (a beam waiting for its group), ``b`` shares a's partial block and
    decodes; an older request ``x`` is mid-prefill and needs two more blocks."""
    a = prefilled(s, "a", n=6)
    b = forked(s, a, "b")
    a.num_computed_tokens = a.num_tokens  # nothing left to compute this step
    x = Request("x", list(range(20, 32)), params())
    x.status = RequestStatus.RUNNING
    x.block_ids = s.pool.allocate(1)
    x.num_computed_tokens = 4
    s.running.insert(0, x)
    return x, a, b


def test_preemption_cancels_the_victims_copy_on_write_of_the_same_step():
    s = make(num_blocks=5)
    x, a, b = idle_sharer_and_writer(s)
    assert a.block_ids == b.block_ids == [0, 1] and x.block_ids == [2]
    out = s.schedule()
    # b copies block 1 into 3; then x finds one free block for two and preempts the newest, b, whose copy
    # has not run: it is dropped (block 3 went back to the pool and is now x's)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert out.block_copies == []
    assert plan(out) == [("x", 4, 8)]
    assert x.block_ids == [2, 3, 4] and a.block_ids == [0, 1] and b.block_ids == []
    assert s.pool.ref_counts == [1, 1, 1, 1, 1]


def test_swapping_out_a_request_whose_copy_has_not_run_saves_the_copy_source():
    s = make(num_blocks=5, mode="swap")
    x, a, b = idle_sharer_and_writer(s)
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"] and b.status is RequestStatus.SWAPPED
    assert out.block_copies == []
    assert out.swap_out == [([0, 1], [0, 1])]  # block 1 (the source) holds what b's block 3 would have
    assert s.pool.ref_counts == [1, 1, 1, 1, 1]


class StubGroup:
    """What the scheduler reads of a beam group: its members, and forgetting the round's rows."""

    def __init__(self, members):
        self.members = members
        self.num_forgotten = 0
        for member in members:
            member.beam_group = self

    def forget_rows(self):
        self.num_forgotten += 1


def test_preempting_one_beam_preempts_its_whole_group_and_it_is_admitted_back_together():
    s = make(num_blocks=7)
    x, a = Request("x", list(range(3, 10)), params()), Request("a", list(range(3, 7)), params())
    s.add(x)
    s.add(a)
    s.update(s.schedule(), {"x": 1, "a": 2})  # x: blocks [0, 1], a: [2]
    b = forked(s, a, "b")
    group = StubGroup([a, b])
    out = s.schedule()  # x writes in place; a and b each take a fresh block
    assert plan(out) == [("x", 7, 1), ("a", 4, 1), ("b", 4, 1)]
    assert (a.block_ids, b.block_ids) == ([2, 3], [2, 4])
    s.update(out, {"x": 1, "a": 2, "b": 3})
    c = Request("c", list(range(40, 48)), params())  # an older request holding the last two blocks
    c.status = RequestStatus.RUNNING
    c.block_ids = s.pool.allocate(2)
    c.num_computed_tokens = 7
    s.running.insert(1, c)
    # x needs a block: the newest running request is b, so the whole group goes back to waiting, in order
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b", "a"]
    assert list(s.waiting) == [a, b] and group.num_forgotten == 1
    assert plan(out) == [("x", 8, 1), ("c", 7, 1)]
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and a.block_ids == b.block_ids == []
    assert a.num_preemptions == b.num_preemptions == 1
    s.update(out, {"x": 1, "c": 2})
    # one block left after c's next one; the group needs 2 + 2: neither beam joins alone
    out = s.schedule()
    assert plan(out) == [("x", 9, 1), ("c", 8, 1)] and list(s.waiting) == [a, b]
    s.update(out, {"x": 1, "c": 2})
    s.finish(c, "stop")
    out = s.schedule()
    assert plan(out) == [("x", 10, 1), ("a", 0, 6), ("b", 0, 6)]
    assert s.running == [x, a, b]


def test_beams_past_the_token_budget_join_with_their_group_and_prefill_next():
    s = make(num_blocks=16, budget=8)
    a = Request("a", list(range(3, 9)), params())
    b = Request("b", list(range(3, 8)) + [60], params())
    StubGroup([a, b])
    s.waiting.extend([a, b])
    out = s.schedule()
    assert plan(out) == [("a", 0, 6), ("b", 0, 2)]
    assert s.running == [a, b]
    c = Request("c", list(range(3, 9)), params())
    d = Request("d", list(range(3, 9)), params())
    StubGroup([c, d])
    s.waiting.extend([c, d])
    s.update(out, {"a": 1})
    out = s.schedule()
    # b (a prefill) gets the budget left after a's decode; c and d join without tokens
    assert plan(out) == [("a", 6, 1), ("b", 2, 4), ("c", 0, 3)]
    assert s.running == [a, b, c, d] and d.block_ids == []


def test_a_parent_is_admitted_only_when_its_forks_fit_under_max_num_seqs():
    s = make(max_num_seqs=4)
    s.add(Request("x", [5, 6, 7], params()))
    p = Request("p", [8, 9], params())
    p.num_forks_pending = 3
    s.add(p)
    out = s.schedule()
    assert plan(out) == [("x", 0, 3)] and list(s.waiting) == [p]


@pytest.mark.parametrize("seed", [0, 123, 2**62 - 1])
def test_sample_seeds_keep_the_first_and_differ_for_the_rest(seed):
    seeds = [sample_seed(seed, i) for i in range(6)]
    assert seeds[0] == seed and len(set(seeds)) == 6
    assert all(0 <= x < 2**62 for x in seeds)
    assert sample_seed(seed + 1, 1) != seeds[1]
