"""Sequences sharing blocks: ref counts through fork, copy-on-write of the last block, beams taking over
their parents' block tables, copies cancelled by preemption, and beam groups admitted and preempted as
a whole (exact expectations)."""

import pytest
from test_scheduler import blocks, params, put_running, update

from hfpaged.core.config import EngineConfig
from hfpaged.core.kv_manager import KVManager
from hfpaged.core.request import Request, RequestGroup, RequestStatus
from hfpaged.core.runner_output import BeamRound, ForkedSample, ModelRunnerOutput, SampledToken
from hfpaged.core.scheduler import Scheduler
from hfpaged.model.input_batch import InputBatch
from hfpaged.sampling.parallel_sampling import sample_seed


def make(num_blocks=16, budget=100, mode="recompute", max_num_seqs=8):
    config = EngineConfig(
        block_size=4,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        watermark=0.0,
        enable_prefix_caching=False,
        preemption_mode=mode,
    )
    return Scheduler(
        config, KVManager(num_blocks, 4, enable_prefix_caching=False, num_cpu_blocks=8 if mode == "swap" else 0)
    )


def prefilled(s, rid="p", n=6, token=50):
    """A request whose n-token prompt is computed and which has sampled its first token."""
    r = Request(rid, list(range(3, 3 + n)), params())
    s.add(r)
    update(s, s.schedule(), {rid: token})
    return r


def forked(s, parent, rid="p.1", token=60):
    """``rid`` shares ``parent``'s blocks and progress and runs, with its own last token (what the scheduler
    does to a forked sample or a new beam)."""
    child = Request(rid, parent.prompt_token_ids, params())
    child.all_token_ids = parent.all_token_ids[:-1] + [token]
    s.kv.fork(child, parent)
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = RequestStatus.RUNNING
    s.requests[rid] = child
    s.running.append(child)
    return child


def plan(out):
    return [(x.request_id, x.start, x.num_tokens) for x in out.scheduled]


def test_fork_shares_every_block_and_the_last_one_is_copied_on_first_write():
    s = make()
    parent = prefilled(s, n=6)  # blocks [0, 1]: one full block, one holding 2 of 4 slots
    child = forked(s, parent)
    assert blocks(s, child) == [0, 1] and child.num_computed_tokens == 6 and child.status is RequestStatus.RUNNING
    assert s.running == [parent, child]
    assert s.kv.pool.ref_counts[:3] == [2, 2, 0]
    out = s.schedule()
    assert plan(out) == [("p", 6, 1), ("p.1", 6, 1)]
    # the parent writes first: it copies the shared block 1 into block 2; the child then owns block 1 alone
    assert out.block_copies == [(1, 2)]
    assert blocks(s, parent) == [0, 2] and blocks(s, child) == [0, 1]
    assert s.kv.pool.ref_counts[:4] == [2, 1, 1, 0]
    # the runner hears of the parent's new block as a diff of its table from index 1 on
    assert [(d.request_id, d.start, d.block_ids) for d in out.cached_requests] == [("p", 1, [2])]
    update(s, out, {"p": 51, "p.1": 61})
    s.finish(child, "stop")
    assert s.kv.pool.ref_counts[:3] == [1, 0, 1]
    s.finish(parent, "stop")
    assert s.kv.pool.all_free()


def test_a_fork_at_a_block_boundary_needs_no_copy():
    s = make()
    parent = prefilled(s, n=8)
    forked(s, parent)
    out = s.schedule()
    assert out.block_copies == []
    assert [blocks(s, r) for r in s.running] == [[0, 1, 2], [0, 1, 3]]
    assert s.kv.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_update_forks_children_with_their_own_tokens_and_stop_checks():
    s = make()
    parent = Request("p", list(range(3, 9)), params(eos=(99,)))
    RequestGroup(parent, 3)
    s.add(parent)
    out = s.schedule()
    assert out.new_requests[0].num_forks == 2
    forks = [ForkedSample(i, params(eos=(99,)), SampledToken(t)) for i, t in ((1, 99), (2, 52))]
    outputs = s.update_from_output(out, ModelRunnerOutput(["p"], [50], forks={"p": forks}))
    children = parent.group.members[1:]
    assert [(o.request_id, o.prompt_id, o.sequence_index, o.new_token_ids) for o in outputs] == [
        ("p", "p", 0, [50]),
        ("p.1", "p", 1, [99]),
        ("p.2", "p", 2, [52]),
    ]
    assert [r.output_token_ids for r in parent.group.members] == [[50], [99], [52]]
    assert parent.num_forks_pending == 0
    assert children[0].finish_reason == "stop" and blocks(s, children[0]) == []  # eos at once: released
    assert s.running == [parent, children[1]]
    assert s.kv.pool.ref_counts[:3] == [2, 2, 0]


class StubSearch:
    """What the scheduler uses of a beam search: ``commit`` when it takes a round, its returned sequences once it
    has ended."""

    aborted = False
    commits = 0

    def commit(self):
        self.commits += 1

    def returned_sequences(self):
        return []


def beams(*members):
    group = RequestGroup(members[0], len(members), beam_search=StubSearch())
    group.members = list(members)
    for slot, member in enumerate(members):
        member.group = group
        member.sequence_index = slot
    return group


def test_a_beam_round_moves_beams_onto_their_parents_tables_and_frees_the_rest():
    s = make()
    a = prefilled(s, "a", n=6)
    b = forked(s, a, "b", token=70)
    beams(a, b)
    out = s.schedule()  # both compute their token; a copies the shared block 1 -> 2 first
    update(s, out, {})
    assert blocks(s, a) == [0, 2] and blocks(s, b) == [0, 1] and a.num_computed_tokens == b.num_computed_tokens == 7
    # the selection continues a twice and b not at all: b's own block 1 goes back to the pool
    s.update_from_output(out, ModelRunnerOutput(beam_rounds=[BeamRound("a", [0, 0], [11, 12], True)]))
    assert a.group.beam_search.commits == 1  # the search may forget the round's undo state
    assert blocks(s, a) == blocks(s, b) == [0, 2] and b.num_computed_tokens == 7
    assert a.all_token_ids[-2:] == [50, 11] and b.all_token_ids[-2:] == [50, 12]
    assert s.kv.pool.ref_counts[:3] == [2, 0, 2] and s.kv.pool.num_free_blocks == 14
    # a selection that swaps them around keeps every count
    s.kv.share([a, b], [b, a])
    assert s.kv.pool.ref_counts[:3] == [2, 0, 2]
    # the runner rebuilds both beams' state: they are dropped, then sent whole
    out = s.schedule()
    assert out.dropped_ids == ["a", "b"] and [n.request_id for n in out.new_requests] == ["a", "b"]
    assert [n.token_ids[-1] for n in out.new_requests] == [11, 12]
    s.finish(a, "stop")
    s.finish(b, "stop")
    assert s.kv.pool.all_free()


def idle_sharer_and_writer(s):
    """``a`` has computed everything (a beam waiting for its group), ``b`` shares a's partial block and
    decodes; an older request ``x`` is mid-prefill and needs two more blocks."""
    a = prefilled(s, "a", n=6)
    b = forked(s, a, "b")
    a.num_computed_tokens = a.num_tokens  # nothing left to compute this step
    x = Request("x", list(range(20, 32)), params())
    put_running(s, x, num_blocks=1, num_computed=4, at=0)
    return x, a, b


def test_preemption_cancels_the_victims_copy_on_write_of_the_same_step():
    s = make(num_blocks=5)
    x, a, b = idle_sharer_and_writer(s)
    assert blocks(s, a) == blocks(s, b) == [0, 1] and blocks(s, x) == [2]
    out = s.schedule()
    # b copies block 1 into 3; then x finds one free block for two and preempts the newest, b, whose copy
    # has not run: it is dropped (block 3 went back to the pool and is now x's)
    assert out.preempted_ids == ["b"]
    assert out.block_copies == []
    assert plan(out) == [("x", 4, 8)]
    assert blocks(s, x) == [2, 3, 4] and blocks(s, a) == [0, 1] and blocks(s, b) == []
    assert s.kv.pool.ref_counts == [1, 1, 1, 1, 1]


def test_swapping_out_a_request_whose_copy_has_not_run_saves_the_copy_source():
    s = make(num_blocks=5, mode="swap")
    x, a, b = idle_sharer_and_writer(s)
    out = s.schedule()
    assert out.preempted_ids == ["b"] and b.status is RequestStatus.SWAPPED
    assert out.block_copies == []
    assert out.swap_out == [([0, 1], [0, 1])]  # block 1 (the source) holds what b's block 3 would have
    assert s.kv.pool.ref_counts == [1, 1, 1, 1, 1]


class CountingSearch(StubSearch):
    """A beam search that counts how often the runner drops its round's rows."""

    def __init__(self):
        self.num_forgotten = 0

    def forget_rows(self):
        self.num_forgotten += 1


def test_preempting_one_beam_preempts_its_whole_group_and_it_is_admitted_back_together():
    s = make(num_blocks=7)
    batch = InputBatch(block_size=4)  # the runner's side: it hears of every step

    def schedule():
        out = s.schedule()
        batch.update(out)
        return out

    x, a = Request("x", list(range(3, 10)), params()), Request("a", list(range(3, 7)), params())
    s.add(x)
    s.add(a)
    update(s, schedule(), {"x": 1, "a": 2})  # x: blocks [0, 1], a: [2]
    b = forked(s, a, "b")
    group = beams(a, b)
    search = group.beam_search = CountingSearch()
    out = schedule()  # x writes in place; a and b each take a fresh block
    assert plan(out) == [("x", 7, 1), ("a", 4, 1), ("b", 4, 1)]
    assert (blocks(s, a), blocks(s, b)) == ([2, 3], [2, 4])
    update(s, out, {"x": 1, "a": 2, "b": 3})
    c = Request("c", list(range(40, 48)), params())  # an older request holding the last two blocks
    put_running(s, c, num_blocks=2, num_computed=7, at=1)
    # x needs a block: the newest running request is b, so the whole group goes back to waiting, in order
    out = schedule()
    assert out.preempted_ids == ["b", "a"]
    assert list(s.waiting) == [a, b] and search.num_forgotten == 1  # the runner drops the round's rows once
    assert plan(out) == [("x", 8, 1), ("c", 7, 1)]
    assert a.num_computed_tokens == b.num_computed_tokens == 0 and blocks(s, a) == blocks(s, b) == []
    assert a.num_preemptions == b.num_preemptions == 1
    update(s, out, {"x": 1, "c": 2})
    # one block left after c's next one; the group needs 2 + 2: neither beam joins alone
    out = schedule()
    assert plan(out) == [("x", 9, 1), ("c", 8, 1)] and list(s.waiting) == [a, b]
    update(s, out, {"x": 1, "c": 2})
    s.finish(c, "stop")
    out = schedule()
    assert plan(out) == [("x", 10, 1), ("a", 0, 6), ("b", 0, 6)]
    assert s.running == [x, a, b]


def queue_beams(s, *members):
    beams(*members)
    for member in members:
        s.requests[member.request_id] = member
        s.waiting.append(member)


def test_beams_past_the_token_budget_join_with_their_group_and_prefill_next():
    s = make(num_blocks=16, budget=8)
    a = Request("a", list(range(3, 9)), params())
    b = Request("b", list(range(3, 8)) + [60], params())
    queue_beams(s, a, b)
    out = s.schedule()
    assert plan(out) == [("a", 0, 6), ("b", 0, 2)]
    assert s.running == [a, b]
    c = Request("c", list(range(3, 9)), params())
    d = Request("d", list(range(3, 9)), params())
    queue_beams(s, c, d)
    update(s, out, {"a": 1})
    out = s.schedule()
    # b (a prefill) gets the budget left after a's decode; c and d join without tokens
    assert plan(out) == [("a", 6, 1), ("b", 2, 4), ("c", 0, 3)]
    assert s.running == [a, b, c, d] and blocks(s, d) == []


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
