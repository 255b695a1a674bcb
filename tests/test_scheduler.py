"""Scheduler decisions with exact expectations: budget, chunking, admission, preemption, resumption."""

from transformers import GenerationConfig

from hfpaged.core.config import EngineConfig
from hfpaged.core.kv_manager import KVManager
from hfpaged.core.request import LONG_ROPE_SALT, Request, RequestStatus
from hfpaged.core.runner_output import ModelRunnerOutput
from hfpaged.core.scheduler import Scheduler
from hfpaged.core.scheduler_output import SchedulerOutput
from hfpaged.sampling.params import RequestParams


def params(max_length=1000, eos=()):
    """Greedy settings with no processors (the scheduler reads only lengths and stop rules)."""
    return RequestParams(
        generation_config=GenerationConfig(),
        max_length=max_length,
        eos_token_ids=frozenset(eos),
        do_sample=False,
        seed=0,
    )


def request(rid, n, **kw):
    return Request(rid, list(range(3, 3 + n)), params(**kw))


def make(num_blocks=32, block_size=4, budget=10, max_num_seqs=8, watermark=0.0):
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        watermark=watermark,
        enable_prefix_caching=False,
    )
    return Scheduler(config, KVManager(num_blocks, block_size, enable_prefix_caching=False))


def plan(out):
    return [(s.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled]


def update(s, out, tokens):
    """What the runner would return: ``tokens`` (request id -> sampled token) for the rows it sampled."""
    return s.update_from_output(out, ModelRunnerOutput(list(tokens), list(tokens.values())))


def step(s, token=7):
    out = s.schedule()
    update(s, out, {x.request_id: token for x in out.scheduled if x.samples})
    return out


def blocks(s, r):
    return s.kv.block_ids(r)


def put_running(s, r, num_blocks, num_computed, at=None):
    """Set up ``r`` as running with ``num_blocks`` blocks and ``num_computed`` tokens computed (state the
    admission policy rarely produces by itself)."""
    assert s.kv.allocate(r, num_blocks * s.kv.block_size)
    r.num_computed_tokens = num_computed
    r.status = RequestStatus.RUNNING
    s.requests[r.request_id] = r
    s.running.insert(len(s.running) if at is None else at, r)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = make(budget=10)
    a = request("a", 25)
    s.add(a)
    assert plan(step(s)) == [("a", 0, 10, False)]
    assert blocks(s, a) == [0, 1, 2]
    assert plan(step(s)) == [("a", 10, 10, False)]
    assert blocks(s, a) == [0, 1, 2, 3, 4]
    assert plan(step(s)) == [("a", 20, 5, True)]
    assert a.num_tokens == 26 and a.num_computed_tokens == 25
    assert plan(step(s)) == [("a", 25, 1, True)]
    assert blocks(s, a) == [0, 1, 2, 3, 4, 5, 6]


def test_decodes_first_then_prefill_fills_the_rest_of_the_budget():
    s = make(budget=10)
    a = request("a", 4)
    s.add(a)
    step(s)  # a: prefill, samples
    b = request("b", 20)
    s.add(b)
    assert plan(step(s)) == [("a", 4, 1, True), ("b", 0, 9, False)]


def test_running_chunked_prefill_goes_after_newer_decodes():
    s = make(budget=8)
    a = request("a", 30)
    s.add(a)
    step(s)  # a computed 8 of 30
    b = request("b", 2)
    # b admitted after a; make it a decode by prefilling it alone in a fresh step budget
    s.add(b)
    out = step(s)
    assert plan(out) == [("a", 8, 8, False)]  # budget went to a first (running before waiting)
    out = step(s)
    assert plan(out) == [("a", 16, 8, False)]
    out = step(s)
    assert plan(out) == [("a", 24, 6, True), ("b", 0, 2, True)]
    out = step(s)
    assert plan(out) == [("a", 30, 1, True), ("b", 2, 1, True)]


def test_max_num_seqs_limits_admission():
    s = make(max_num_seqs=2, budget=100)
    for rid in "abc":
        s.add(request(rid, 3))
    out = step(s)
    assert [p[0] for p in plan(out)] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_admission_needs_blocks_for_the_chunk_above_the_watermark():
    s = make(num_blocks=10, budget=100, watermark=0.2)  # keep 2 blocks free while others run
    s.add(request("a", 16))  # 4 blocks
    assert plan(step(s)) == [("a", 0, 16, True)]
    s.add(request("b", 16))  # would leave 10-5-4=1 < 2 free
    out = step(s)
    assert plan(out) == [("a", 16, 1, True)]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_newest_request_is_preempted_by_recompute_and_resumes():
    s = make(num_blocks=4, block_size=4, budget=100)
    a, b = request("a", 8), request("b", 8)
    s.add(a)
    s.add(b)
    out = step(s)
    assert plan(out) == [("a", 0, 8, True), ("b", 0, 8, True)]
    assert s.kv.pool.num_free_blocks == 0
    # a now has 9 tokens and needs a third block: b (newest) is preempted
    out = step(s)
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and blocks(s, b) == []
    assert b.num_preemptions == 1 and s.counters["num_preemptions"] == 1
    assert list(s.waiting) == [b]
    assert b.all_token_ids == list(range(3, 11)) + [7]  # keeps its generated token
    # no admission in a step that preempted; next step b cannot fit (a holds 3 of 4 blocks)
    out = step(s)
    assert plan(out) == [("a", 10 - 1, 1, True)]
    assert blocks(s, a) == [0, 1, 2]
    s.finish(a, "stop")
    out = step(s)
    assert plan(out) == [("b", 0, 9, True)]  # recomputes prompt + its generated token, then samples


def test_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=4, block_size=4, budget=100)
    a, b = request("a", 7), request("b", 8)
    s.add(a)
    s.add(b)
    step(s)  # a: 7 tokens + 1 sampled = 8 (fits 2 blocks); b: 8 + 1 = 9 (needs a 3rd block)
    out = step(s)
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 7, 1, True)]


def test_a_decode_preempts_the_newest_running_request():
    s = make(num_blocks=6, block_size=4, budget=8)
    a = request("a", 20)
    s.add(a)
    step(s)
    b = request("b", 3)
    s.add(b)
    step(s)  # a takes the whole budget again: b waits
    assert blocks(s, a) == [0, 1, 2, 3] and s.waiting[0] is b
    out = step(s)
    assert plan(out) == [("a", 16, 4, True), ("b", 0, 3, True)]
    assert s.kv.pool.num_free_blocks == 0
    out = s.schedule()  # a needs a 6th block at 21 tokens: b, the newest, goes
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 20, 1, True)]


def test_an_already_scheduled_victim_is_unscheduled_and_its_budget_returned():
    # An older request still mid-prefill behind a newer decode (set up directly: the admission
    # policy rarely produces it). The decode is scheduled first; when the prefill chunk then needs
    # blocks, the newest request - already scheduled - is preempted and its budget given back.
    s = make(num_blocks=4, block_size=4, budget=8)
    a, b = request("a", 12), request("b", 4)
    put_running(s, a, num_blocks=1, num_computed=4)
    b.all_token_ids.append(7)
    put_running(s, b, num_blocks=2, num_computed=4)
    out = s.schedule()  # b (decode) first; a needs 2 more blocks for 8 tokens, only 1 free
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 4, 8, True)]
    assert blocks(s, a) == [0, 1, 2] and blocks(s, b) == []  # b's freed blocks are reused first


def test_finished_requests_free_their_blocks():
    s = make(num_blocks=8, budget=100)
    a = request("a", 5, eos=(9,))
    s.add(a)
    out = s.schedule()
    update(s, out, {"a": 9})
    assert a.status is RequestStatus.FINISHED and a.finish_reason == "stop"
    assert s.kv.pool.all_free() and not s.has_unfinished()


def test_length_stop_and_eos_take_precedence_in_order():
    s = make(num_blocks=8, budget=100)
    a = request("a", 5, max_length=6, eos=(9,))
    b = request("b", 5, max_length=6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    update(s, out, {"a": 9, "b": 4})
    assert (a.finish_reason, b.finish_reason) == ("stop", "length")
    assert s.kv.pool.all_free()


def test_a_request_growing_past_restart_past_is_computed_again_from_its_first_token_with_the_salt():
    # a longrope model whose generate recomputes a sequence long past L tokens (Phi-3, model/long_rope.py)
    s = make(budget=10)
    a, b = request("a", 3), request("b", 2)
    a.restart_past = b.restart_past = 4
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 0, 3, True), ("b", 0, 2, True)]
    assert plan(step(s)) == [("a", 3, 1, True), ("b", 2, 1, True)]  # a: 5 tokens now, its keys short
    out = step(s)  # a starts over (in the same step: a restart frees blocks, it is not for room); b decodes on
    assert out.preempted_ids == ["a"] and plan(out) == [("b", 3, 1, True), ("a", 0, 5, True)]
    assert a.cache_salt == LONG_ROPE_SALT and b.cache_salt is None
    out = step(s)  # b has grown past 4 now
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 5, 1, True), ("b", 0, 5, True)]
    assert b.cache_salt == LONG_ROPE_SALT
    assert plan(step(s)) == [("a", 6, 1, True), ("b", 5, 1, True)]
    assert s.counters["num_preemptions"] == 0 and a.num_preemptions == 0  # restarts are not preemptions


def test_a_waiting_or_swapped_request_past_restart_past_is_salted_and_computed_from_its_first_token():
    config = EngineConfig(block_size=4, num_blocks=32, max_num_batched_tokens=10, preemption_mode="swap")
    s = Scheduler(config, KVManager(32, 4, num_cpu_blocks=8))
    a, b = request("a", 5), request("b", 6)
    s.add(a)
    s.add(b)
    step(s)
    s._preempt_one(a, SchedulerOutput(), allow_swap=True)  # swapped out with its (short) keys
    s._preempt_one(b, SchedulerOutput(), allow_swap=False)  # waiting, recompute
    assert a.status is RequestStatus.SWAPPED and b.status is RequestStatus.WAITING
    hashes = s.kv._hashes.get("b")
    a.restart_past = b.restart_past = 4
    s._restarting = True  # (Scheduler.add sets it for a request added with a restart point)
    out = step(s)
    assert a.status is RequestStatus.RUNNING and a.cache_salt == LONG_ROPE_SALT == b.cache_salt
    assert not out.swap_in and plan(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert hashes is None or s.kv._hashes.get("b") != hashes
    assert s.kv.cpu_pool.all_free()
