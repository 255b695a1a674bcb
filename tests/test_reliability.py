"""Outside the happy path: numerical faults, interrupts and out-of-memory inside a step, weights that
change after ``patch``, swap-space sizing, freeing on ``del model``, and every malformed input."""

import gc
import signal
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch
from models import make_model, random_prompts, reference_generate
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria, TextStreamer

import hfpaged
from hfpaged.sampling.sampler import StepResult


@pytest.fixture
def model():
    m = make_model("llama", seed=21)
    hfpaged.patch(m, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    return m


def all_free(m):
    st = hfpaged.stats(m)
    return st["num_free_blocks"] == st["num_blocks"] and st["num_free_cpu_blocks"] == st["num_cpu_blocks"]


def exact(m, prompts, **kwargs):
    got = [r.token_ids for r in m.generate_many(prompts, max_new_tokens=8, do_sample=False, **kwargs)]
    return got == reference_generate(m, prompts, max_new_tokens=8, do_sample=False, **kwargs)


class PoisonAfter(LogitsProcessor):
    """Turns the scores into NaN once the sequence has ``length`` tokens."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] >= self.length:
            return torch.full_like(scores, float("nan"))
        return scores


# --- numerical faults ----------------------------------------------------------------------------


def test_nan_scores_while_sampling_raise_like_stock_generate_and_name_the_prompt(model):
    prompts = random_prompts([4, 9, 6], seed=1)
    poison = {"prompt": prompts[1], "logits_processor": [PoisonAfter(len(prompts[1]) + 2)]}
    with pytest.raises(RuntimeError, match=r"multinomial|probability tensor contains"):
        model.generate(torch.tensor([prompts[1]]), do_sample=True, max_new_tokens=6, logits_processor=[PoisonAfter(11)])
    with pytest.raises(RuntimeError, match=r"prompt 1: the probability tensor contains `inf`, `nan`"):
        model.generate_many([prompts[0], poison, prompts[2]], do_sample=True, max_new_tokens=6)
    assert all_free(model)
    assert exact(model, prompts)


def test_in_the_engine_api_a_nan_request_finishes_with_an_error_and_the_others_go_on(model):
    prompts = random_prompts([4, 9, 6], seed=2)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    engine = hfpaged.Engine(model)
    ids = [engine.add_request(p, max_new_tokens=8, do_sample=False) for p in prompts]
    bad = engine.add_request(prompts[1], max_new_tokens=8, do_sample=True, logits_processor=[PoisonAfter(11)])
    gained, finished = {rid: [] for rid in ids + [bad]}, {}
    while engine.has_unfinished():
        for out in engine.step():
            gained[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
    assert [gained[rid] for rid in ids] == expected
    assert finished[bad][0] == "error" and "probability tensor contains" in finished[bad][1]
    assert len(gained[bad]) == 11 - len(prompts[1])  # its tokens before the NaN step
    assert all_free(model)


# --- failures inside a step ------------------------------------------------------------------------


def test_out_of_memory_inside_a_step_says_what_to_lower_and_leaves_everything_usable(model, monkeypatch):
    prompts = random_prompts([5, 14, 30], seed=3)
    mlp = model.model.layers[0].mlp  # layer 0: the K/V of layer 1 depend on it (cached prefix blocks go stale)
    real = mlp.forward
    calls = {"n": 0}

    def exhausted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(mlp, "forward", exhausted)
    with pytest.raises(torch.OutOfMemoryError, match=r"Lower max_num_batched_tokens \(now 32\)") as info:
        model.generate_many(prompts, max_new_tokens=8, do_sample=False)
    assert "Tried to allocate 2.00 GiB" in str(info.value) and "in a step of" in str(info.value)
    assert all_free(model)
    monkeypatch.undo()
    assert exact(model, prompts)


def test_an_interrupt_while_waiting_for_a_step_frees_everything(model, monkeypatch):
    prompts = random_prompts([5, 14, 30, 9], seed=4)
    real = StepResult.result
    calls = {"n": 0}

    def interrupted(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(StepResult, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model.generate_many(prompts, max_new_tokens=8, do_sample=False)
    assert all_free(model) and not model._hfpaged.engine.scheduler.requests
    monkeypatch.undo()
    assert exact(model, prompts)


class InterruptAt(LogitsProcessor):
    """Raises KeyboardInterrupt at its ``when``-th call (a user's Ctrl-C inside a step)."""

    def __init__(self, when):
        self.calls, self.when = 0, when

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.when:
            raise KeyboardInterrupt
        return scores


@pytest.mark.parametrize("when", [1, 2, 4], ids=["first-round", "second-round", "fourth-round"])
def test_a_beam_search_beside_a_step_that_was_interrupted_stays_exact(when):
    # another request's processor raises in the step that completes a beam round: the round, already selected,
    # is undone with the step (else its token came twice, or the first round's forks never came: a stall)
    m = make_model("llama", seed=5)
    prompt = random_prompts([12], seed=8)[0]
    beam = dict(max_new_tokens=8, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), pad_token_id=0, return_dict_in_generate=True, **beam)
    lengths = (out.beam_indices != -1).sum(-1).tolist()
    expected = [s[len(prompt) :][:n] for s, n in zip(out.sequences.tolist(), lengths)]
    hfpaged.patch(m, num_blocks=40, block_size=4)
    engine = hfpaged.Engine(m)
    beam_id = engine.add_request(prompt, **beam)
    engine.add_request([5, 6, 7], max_new_tokens=6, do_sample=False, logits_processor=[InterruptAt(when)])
    got, interrupts = {}, 0
    while engine.has_unfinished():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        got.update({o.sequence_index: o.token_ids for o in outputs if o.prompt_id == beam_id and o.finished})
    assert interrupts == 1
    assert [got[i] for i in sorted(got)] == expected
    assert all_free(m)


class CriterionRaisingAt(StoppingCriteria):
    """A stopping criterion that raises ``error`` (a KeyboardInterrupt, SystemExit) at its ``when``-th call."""

    def __init__(self, when, error=KeyboardInterrupt):
        self.calls, self.when, self.error = 0, when, error

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls == self.when:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_engine(engine, watched, errors=(KeyboardInterrupt, SystemExit)):
    """Step ``engine`` to the end, catching ``errors``: (each watched prompt's streamed ids, its finished outputs in
    the order they came, the number of errors caught, the last of them)."""
    streamed, final, caught, last = {p: [] for p in watched}, {p: [] for p in watched}, 0, None
    for _ in range(200):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except errors as error:
            caught, last = caught + 1, error
            continue
        for output in outputs:
            if output.prompt_id in watched:
                streamed[output.prompt_id] += output.new_token_ids
                if output.finished:
                    final[output.prompt_id].append(output)
    return streamed, final, caught, last


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit], ids=["interrupt", "exit"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("when", [1, 3, 4])
def test_a_stopping_criterion_raising_an_interrupt_leaves_the_step_whole(when, async_scheduling, error):
    # the interrupt reaches the caller once the step's outputs are out: before, the step's tokens were appended but
    # neither stop-checked nor delivered (a request ran past its length, streams missed tokens, a beam search that
    # ended in that step never delivered: its caller waited forever)
    m = make_model("llama", seed=5)
    greedy_prompt, beam_prompt, other = random_prompts([7, 12, 9], seed=8)
    expected = reference_generate(m, [greedy_prompt], max_new_tokens=4, do_sample=False)[0]
    beam = dict(max_new_tokens=4, num_beams=2, num_return_sequences=2, do_sample=False)
    with torch.no_grad():
        out = m.generate(torch.tensor([beam_prompt]), pad_token_id=0, return_dict_in_generate=True, **beam)
    lengths = (out.beam_indices != -1).sum(-1).tolist()
    beams = [s[len(beam_prompt) :][:n] for s, n in zip(out.sequences.tolist(), lengths)]
    hfpaged.patch(m, num_blocks=40, block_size=4, async_scheduling=async_scheduling)
    engine = hfpaged.Engine(m)
    greedy_id = engine.add_request(greedy_prompt, max_new_tokens=4, do_sample=False)
    beam_id = engine.add_request(beam_prompt, **beam)
    engine.add_request(other, max_new_tokens=6, do_sample=False, stopping_criteria=[CriterionRaisingAt(when, error)])
    streamed, final, interrupts, _ = run_engine(engine, {greedy_id, beam_id})
    assert interrupts == 1
    assert [streamed[greedy_id]] == [o.token_ids for o in final[greedy_id]] == [expected]
    assert [o.token_ids for o in sorted(final[beam_id], key=lambda o: o.sequence_index)] == beams
    assert all_free(m)


@pytest.mark.parametrize("new_tokens", [2, 3])
def test_an_interrupt_before_the_second_of_two_updates_still_delivers_the_first(new_tokens, monkeypatch):
    # async scheduling: a step applies the overlapped step before it, then its own; an interrupt between the two
    # (a Ctrl-C) must not lose what the first made (before: X's tokens went missing from its stream, or X, finished
    # by the first, never reported it and its caller waited forever)
    from hfpaged.core.scheduler import Scheduler

    m = make_model("llama", seed=0)
    x_prompt, y_prompt = random_prompts([7, 9], seed=1)
    expected = reference_generate(m, [x_prompt], max_new_tokens=new_tokens, do_sample=False)[0]
    hfpaged.patch(m, num_blocks=64, block_size=4, async_scheduling=True)
    core_class = type(m._hfpaged.engine)
    real_step, real_update = core_class.step, Scheduler.update_from_output
    updates, fired = [0], []

    def step(self):
        updates[0] = 0
        return real_step(self)

    def update_from_output(self, *args, **kwargs):
        updates[0] += 1
        if updates[0] == 2 and not fired:  # the step's own tokens, after the overlapped step's
            fired.append(1)
            raise KeyboardInterrupt
        return real_update(self, *args, **kwargs)

    monkeypatch.setattr(core_class, "step", step)
    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    for delay in range(1, new_tokens + 1):  # X alone (overlapped), then Y, whose penalty reads history: no overlap
        fired.clear()
        engine = hfpaged.Engine(m)
        x = engine.add_request(x_prompt, max_new_tokens=new_tokens, do_sample=False)
        streamed, final, steps, interrupts = [], None, 0, 0
        while engine.has_unfinished() and steps < 50:
            if steps == delay:
                engine.add_request(y_prompt, max_new_tokens=4, do_sample=False, repetition_penalty=1.3)
            steps += 1
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                interrupts += 1
                continue
            for output in outputs:
                if output.prompt_id == x:
                    streamed += output.new_token_ids
                    final = output.token_ids if output.finished else final
        assert fired and interrupts == 1 and streamed == final == expected, delay
        assert all_free(m)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_interrupt_inside_a_preemption_loses_no_request(mode, monkeypatch):
    # the victim leaves `running` before the KV manager frees or swaps its blocks: an interrupt between left it in no
    # queue (never finished, later steps "made no progress", its CPU blocks leaked, unpatch raised)
    import inspect

    m = make_model("llama", seed=3)
    prompts = random_prompts([9, 13, 7, 11, 10, 12], seed=11)
    expected = reference_generate(m, prompts, max_new_tokens=16, do_sample=False)
    hfpaged.patch(m, num_blocks=14, block_size=4, preemption_mode=mode, async_scheduling=False)
    engine = hfpaged.Engine(m)
    kv = engine.core.kv
    name = "swap_out" if mode == "swap" else "free"
    real, fired = getattr(kv, name), []

    def interrupted(request, *args, **kwargs):
        result = real(request, *args, **kwargs)
        if not fired and inspect.stack()[1].function == "_preempt_one":
            fired.append(1)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(kv, name, interrupted)
    ids = [engine.add_request(p, max_new_tokens=16, do_sample=False) for p in prompts]
    _, final, interrupts, _ = run_engine(engine, set(ids))
    assert fired and interrupts == 1
    assert [[o.token_ids for o in final[i]] for i in ids] == [[e] for e in expected]
    assert all_free(m)
    hfpaged.unpatch(m)


def two_prompts_engine(async_scheduling):
    """A llama, two prompts, stock greedy's 5 tokens for each, and an ``Engine`` handle on the patched model."""
    m = make_model("llama", seed=0)
    prompts = random_prompts([7, 9], seed=1)
    expected = reference_generate(m, prompts, max_new_tokens=5, do_sample=False)
    hfpaged.patch(m, num_blocks=64, block_size=4, async_scheduling=async_scheduling)
    return m, prompts, expected, hfpaged.Engine(m)


def ctrl_c_at(monkeypatch, owner, name, calls, times=1, handler=signal.default_int_handler):
    """Wrap ``owner.name`` so that its ``calls``-th call first receives ``times`` real Ctrl-Cs (SIGINT, Python's
    default handler as in a terminal, or ``handler``), each landing at once inside that call."""
    previous = signal.signal(signal.SIGINT, handler)
    real, count, fired = getattr(owner, name), [0], []

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] in calls:
            fired.append(count[0])
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return fired, previous


def run_restoring(engine, prompts, previous):
    """Add ``prompts`` (5 greedy tokens each) to ``engine`` and step it to the end (``run_engine``), then put back
    SIGINT's ``previous`` handler: (the prompts' ids, then what ``run_engine`` returns)."""
    try:
        ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
        return (ids, *run_engine(engine, set(ids)))
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("where", ["check_stops", "append_token", "schedule", "deliver"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_ctrl_c_during_a_step_waits_for_the_step_and_its_delivery(where, async_scheduling, monkeypatch):
    # a Ctrl-C landing in the step's host code after tokens were appended (before their stop checks or their
    # delivery) lost them: streams missed a token, a request ran one token past its length, a finished prompt never
    # reported. The first Ctrl-C now waits for the step and its delivery, then raises.
    from hfpaged.core import request, scheduler

    m, prompts, expected, engine = two_prompts_engine(async_scheduling)
    owner, name = {
        "check_stops": (scheduler, "check_stops"),
        "append_token": (request.Request, "append_token"),
        "schedule": (scheduler.Scheduler, "schedule"),
        "deliver": (type(engine.core), "_deliver"),
    }[where]
    fired, previous = ctrl_c_at(monkeypatch, owner, name, calls={2, 5, 9})
    ids, streamed, final, interrupts, _ = run_restoring(engine, prompts, previous)
    assert fired and interrupts == len(fired)
    assert [[streamed[i]] for i in ids] == [[o.token_ids for o in final[i]] for i in ids] == [[e] for e in expected]
    assert all_free(m)
    hfpaged.unpatch(m)


def _raising_handler(signum, frame):
    raise KeyboardInterrupt("the program's own handler")


@pytest.mark.parametrize("where", ["append_token", "finish", "free", "deliver"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_programs_own_sigint_handler_is_called_once_the_step_is_whole(where, async_scheduling, monkeypatch):
    # a SIGINT handler of the program's own that raises KeyboardInterrupt struck at any bytecode of the step: between
    # a request leaving the scheduler's table and its status change (its handle unfinished for ever), inside the
    # block accounting (blocks leaked, or freed twice by the recovery: "freed more often than it was referenced"),
    # after a token was appended but before its stop check (one token past max_new_tokens), or with finished
    # outputs in locals only (lost). Now its signals are held like a Ctrl-C and the handler runs once the step's
    # outputs are out: one KeyboardInterrupt per signal, exact tokens, the pool free.
    from hfpaged.core import block_pool, request, scheduler

    m, prompts, expected, engine = two_prompts_engine(async_scheduling)
    owner, name = {
        "append_token": (request.Request, "append_token"),
        "finish": (scheduler.Scheduler, "finish"),
        "free": (block_pool.BlockPool, "free"),
        "deliver": (type(engine.core), "_deliver"),
    }[where]
    fired, previous = ctrl_c_at(monkeypatch, owner, name, calls={1, 3, 6}, handler=_raising_handler)
    try:
        ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
        streamed, final, interrupts, last = run_engine(engine, set(ids))
        assert signal.getsignal(signal.SIGINT) is _raising_handler  # put back after every step
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fired and interrupts == len(fired) and "own handler" in str(last)
    assert [[streamed[i]] for i in ids] == [[o.token_ids for o in final[i]] for i in ids] == [[e] for e in expected]
    assert all_free(m)
    hfpaged.unpatch(m)


def test_a_programs_own_sigint_handler_hears_of_each_signal_after_the_step(monkeypatch):
    # a handler that does not raise (a server's: it sets a flag) is called once per signal, after the step
    from hfpaged.core import scheduler

    m, prompts, expected, engine = two_prompts_engine(async_scheduling=False)
    heard = []

    def records(signum, frame):
        heard.append((signum, scheduler_calls[0]))

    scheduler_calls = [0]
    real = scheduler.check_stops

    def counting(*args, **kwargs):
        scheduler_calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler, "check_stops", counting)
    fired, previous = ctrl_c_at(monkeypatch, scheduler, "check_stops", calls={2}, times=2, handler=records)
    ids, streamed, final, interrupts, _ = run_restoring(engine, prompts, previous)
    assert fired == [2] and interrupts == 0
    assert [signum for signum, _ in heard] == [signal.SIGINT] * 2
    assert {calls for _, calls in heard} == {2}  # both after the step's check_stops ran, none inside it
    assert [[streamed[i]] for i in ids] == [[e] for e in expected]
    assert all_free(m)


@pytest.mark.parametrize("where", ["pool-free", "table-pop"])
def test_an_error_inside_a_finish_neither_frees_twice_nor_loses_the_request(where, monkeypatch):
    # an internal error inside Scheduler.finish: after the pool freed a request's blocks but before the manager
    # forgot them, the recovery freed them again ("block freed more often than it was referenced", raised from the
    # recovery itself); after the request left the scheduler's table but before its status changed, no queue and
    # no table held it (its handle unfinished for ever). Now both leave a request the recovery finishes or requeues.
    from hfpaged.core import block_pool

    m, prompts, expected, engine = two_prompts_engine(async_scheduling=False)
    fired = []
    if where == "pool-free":
        real = block_pool.BlockPool.free

        def free(self, blocks):
            real(self, blocks)
            if not fired:
                fired.append(list(blocks))
                raise RuntimeError("injected after the pool freed the blocks")

        monkeypatch.setattr(block_pool.BlockPool, "free", free)
    else:

        class PopFails(dict):
            def pop(self, key, *default):
                value = super().pop(key, *default)
                if not fired:
                    fired.append(key)
                    raise RuntimeError("injected after the request left the table")
                return value

        engine.core.scheduler.requests = PopFails(engine.core.scheduler.requests)
    ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
    streamed, final, errors, last = run_engine(engine, set(ids), errors=(RuntimeError,))
    assert fired and errors == 1 and "injected" in str(last)
    assert [[streamed[i]] for i in ids] == [[o.token_ids for o in final[i]] for i in ids] == [[e] for e in expected]
    assert not engine.has_unfinished() and all_free(m)


def test_a_second_ctrl_c_under_asyncio_run_stops_a_later_forward_at_once(monkeypatch):
    # asyncio.run (3.11+) installs its own SIGINT handler: the first Ctrl-C cancels the main task, the second raises.
    # With the program's handler held per step, the second press, landing in a later step's forward, waited for that
    # step (a long forward: its whole length); it raises at once there now, as a second Ctrl-C does
    import asyncio

    m = make_model("llama", seed=0)
    hfpaged.patch(m, num_blocks=64, block_size=4)
    calls, completed = [0], []

    class LongForward(LogitsProcessor):
        def __call__(self, input_ids, scores):
            calls[0] += 1
            if calls[0] in (2, 4):
                signal.raise_signal(signal.SIGINT)  # the first press (call 2), the second (call 4)
            completed.append(calls[0])  # (what follows the signal in the same call)
            return scores

    async def main():
        m.generate_many(
            random_prompts([7], seed=1), max_new_tokens=8, do_sample=False, logits_processor=[LongForward()]
        )

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert 2 in completed and 4 not in completed  # the first press waited for its step; the second stopped it
    assert all_free(m)


def test_a_falsy_sigint_handler_of_the_programs_own_stays_installed():
    m = make_model("llama", seed=0)
    hfpaged.patch(m, num_blocks=32, block_size=4)

    class Collects(list):  # empty, so falsy
        def __call__(self, signum, frame):
            self.append(signum)

    mine = Collects()
    previous = signal.signal(signal.SIGINT, mine)
    try:
        m.generate_many(random_prompts([5], seed=2), max_new_tokens=3)
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("handler", ["exits", "default"])
def test_a_stop_asked_by_a_held_signal_wins_over_the_steps_error(handler, monkeypatch):
    # a Ctrl-C (or a handler's sys.exit) held during a step that then fails with an internal error: the error came
    # out and the request to stop was only its __context__ (a program catching Exception went on). Now the
    # KeyboardInterrupt / SystemExit comes out, from the error; the pool is free and the model usable
    m = make_model("llama", seed=0)
    prompts = random_prompts([7], seed=1)
    expected = reference_generate(m, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(m, num_blocks=64, block_size=4)
    real_step, calls = hfpaged.engine.EngineCore.step, [0]

    def step(self):
        calls[0] += 1
        if calls[0] == 3:
            signal.raise_signal(signal.SIGINT)  # held: the step is running
            raise RuntimeError("internal step error")
        return real_step(self)

    def exits(signum, frame):
        sys.exit("exit requested by Ctrl-C")

    monkeypatch.setattr(hfpaged.engine.EngineCore, "step", step)
    previous = signal.signal(signal.SIGINT, exits if handler == "exits" else signal.default_int_handler)
    try:
        with pytest.raises(SystemExit if handler == "exits" else KeyboardInterrupt) as caught:
            m.generate_many(prompts, max_new_tokens=6, do_sample=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(caught.value.__cause__, RuntimeError)
    monkeypatch.undo()
    assert all_free(m)
    assert [r.token_ids for r in m.generate_many(prompts, max_new_tokens=6, do_sample=False)] == expected


def test_a_ctrl_c_while_an_abort_frees_the_blocks_waits_for_the_abort(monkeypatch):
    # an abort (Engine.abort, a stream closed early, a server's disconnect) runs outside any step: a Ctrl-C inside
    # its block accounting left a request in the scheduler's table in no queue, its blocks leaked for good (stats
    # showed nothing running; sleep refused). Now the abort completes, then the Ctrl-C raises.
    from hfpaged.core import block_pool

    m, prompts, expected, engine = two_prompts_engine(async_scheduling=False)
    ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
    engine.step()
    fired, previous = ctrl_c_at(monkeypatch, block_pool.BlockPool, "free", calls={1})
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.abort(ids[0])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fired == [1]
    streamed, final, _, _ = run_engine(engine, {ids[1]})
    assert [o.token_ids for o in final[ids[1]]] == [expected[1]]
    assert not engine.has_unfinished() and all_free(m)
    hfpaged.sleep(m)  # nothing left running


@pytest.mark.parametrize("where", ["execute", "check_stops", "deliver"])
def test_a_second_ctrl_c_stops_the_forward_at_once_and_waits_elsewhere(where, monkeypatch):
    # the model's forward (and the wait for the device) may take long: a second Ctrl-C there raises at once and the
    # step is recomputed; in the host bookkeeping (stop checks, delivery), which cannot hang and cannot always be
    # undone (a beam round, a fork), both wait for the step. Either way one KeyboardInterrupt, exact tokens, and
    # nothing held over to a later call (before: a Ctrl-C held when the second one struck was raised by the next
    # step, in whichever caller ran it)
    from hfpaged.core import scheduler

    m, prompts, expected, engine = two_prompts_engine(async_scheduling=False)
    owner, name = {
        "execute": (m._hfpaged.engine.runner, "execute"),
        "check_stops": (scheduler, "check_stops"),
        "deliver": (type(engine.core), "_deliver"),
    }[where]
    fired, previous = ctrl_c_at(monkeypatch, owner, name, calls={3}, times=2)
    calls, completed = [0], []  # the calls that ran to their end
    real = getattr(owner, name)

    def tracked(*args, **kwargs):
        calls[0] += 1
        call = calls[0]
        result = real(*args, **kwargs)
        completed.append(call)
        return result

    monkeypatch.setattr(owner, name, tracked)
    ids, streamed, final, interrupts, _ = run_restoring(engine, prompts, previous)
    assert fired == [3] and interrupts == 1
    assert (3 in completed) == (where != "execute")  # the forward stopped at once; the others completed
    assert [[streamed[i]] for i in ids] == [[o.token_ids for o in final[i]] for i in ids] == [[e] for e in expected]
    assert all_free(m)
    assert m.generate_many(prompts, max_new_tokens=2, do_sample=False)  # no interrupt held over


def test_ctrl_cs_inside_a_generation_nested_in_a_step_wait_for_the_outer_step(monkeypatch):
    # a logits processor of model A generates with model B (an Engine handle's beam search of B runs beside): two
    # Ctrl-Cs landing while B's update moves the beams raised half way through the round (A's forward let a second
    # one escape) and B's beams came out wrong. Now the nested step holds them: A's call raises once, B stays exact.
    from transformers import LogitsProcessor

    from hfpaged.core import kv_manager

    a, b = make_model("llama", seed=0), make_model("llama", seed=0)
    beam_prompt = random_prompts([7], seed=1)[0]
    beam = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=3, early_stopping=True)
    with torch.no_grad():
        stock = sorted(b.generate(torch.tensor([beam_prompt]), **beam)[:, 7:].tolist())
    hfpaged.patch(a, num_blocks=64, block_size=4, async_scheduling=False)
    hfpaged.patch(b, num_blocks=64, block_size=4, async_scheduling=False)
    handle = hfpaged.Engine(b)
    handle.add_request(beam_prompt, **beam)
    finals = [o for o in handle.step() if o.finished]  # the beam search's prefill
    fired, previous = ctrl_c_at(monkeypatch, kv_manager.KVManager, "share", calls={2}, times=2)

    class Nested(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not fired:
                b.generate_many(random_prompts([4], seed=3), max_new_tokens=5, do_sample=False)
            return scores

    try:
        with pytest.raises(KeyboardInterrupt):
            a.generate_many(random_prompts([5], seed=2), max_new_tokens=3, logits_processor=[Nested()])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fired == [2]
    while handle.has_unfinished():
        finals += [o for o in handle.step() if o.finished]
    assert sorted(o.token_ids for o in finals) == stock
    assert all_free(a) and all_free(b)


@pytest.mark.parametrize("where", ["fork", "add_member", "share"])
def test_an_error_while_a_prompt_forks_or_moves_its_beams_fails_the_whole_prompt(where, monkeypatch):
    # neither a fork nor a beam round has an undo: a failure half way (an internal error, a KeyboardInterrupt from a
    # SIGINT handler of the program's own) left a sequence that never reported (its caller waited for ever, or a
    # sequence not made yet was missing) or beams that went on from a half-applied round (wrong tokens). Now every
    # sequence of that prompt fails with the error and reports once. Another prompt's beam search in the same
    # update, whose round was not reached, and a greedy request beside are recomputed, exact.
    from hfpaged.core import kv_manager, request

    m = make_model("llama", seed=0)
    prompt, beam_prompt, greedy_prompt = random_prompts([7, 6, 9], seed=1)
    beam = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=3, early_stopping=True)
    with torch.no_grad():
        stock_beams = sorted(m.generate(torch.tensor([beam_prompt]), **beam)[:, 6:].tolist())
    stock_greedy = reference_generate(m, [greedy_prompt], max_new_tokens=6, do_sample=False)[0]
    sampled = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=0)
    hfpaged.patch(m, num_blocks=96, block_size=4, async_scheduling=False)
    owner = request.RequestGroup if where == "add_member" else kv_manager.KVManager
    real, calls = getattr(owner, where), [0]
    engine, other = hfpaged.Engine(m), hfpaged.Engine(m)
    target = engine.add_request(prompt, **(beam if where == "share" else sampled))

    def failing(self, *args, **kwargs):
        members = args[0] if where == "share" else [self.members[0]] if where == "add_member" else [args[1]]
        if members[0].prompt_id == target:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected half way")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, where, failing)
    beam_id = other.add_request(beam_prompt, **beam)
    greedy_id = other.add_request(greedy_prompt, max_new_tokens=6, do_sample=False)
    finished, failures = {engine: [], other: []}, 0
    for _ in range(80):
        if not (engine.has_unfinished() or other.has_unfinished()):
            break
        for handle in (engine, other):
            try:
                finished[handle] += [o for o in handle.step() if o.finished]
            except RuntimeError:
                failures += 1
    assert failures == 1 and calls[0] >= 2
    assert {o.finish_reason for o in finished[engine]} == {"error"}
    indexes = sorted(o.sequence_index for o in finished[engine])
    assert indexes == ([0] if where == "share" else [0, 1, 2])  # a beam search's one output; each sample's
    assert sorted(o.token_ids for o in finished[other] if o.prompt_id == beam_id) == stock_beams
    assert [o.token_ids for o in finished[other] if o.prompt_id == greedy_id] == [stock_greedy]
    assert all_free(m)


@pytest.mark.parametrize("finished", ["length", "beam-end", "past-table"])
def test_an_error_right_after_an_update_finishes_a_request_reports_it_once(finished, monkeypatch):
    # an interrupt (a program's own SIGINT handler) or error landing just after the update finished a request: a
    # request finished at its length gave its last token back and never reported (its handle unfinished for ever);
    # a beam search that ended in the update reported a stale "stop" or nothing; a beam search ended by the learned
    # position table wedged the model. Now a finished request keeps its token and reports once, a beam search that
    # ended without reporting reports the error, and the requests beside are recomputed, exact.
    from hfpaged.core import scheduler

    arch, beam_prompt_len = ("gpt2", 35) if finished == "past-table" else ("llama", 6)
    m = make_model(arch, seed=0, **({"n_positions": 40} if finished == "past-table" else {}))
    target_prompt, other_prompt = random_prompts([beam_prompt_len, 9], seed=1)
    other_expected = reference_generate(m, [other_prompt], max_new_tokens=3, do_sample=False)[0]
    hfpaged.patch(m, num_blocks=96, block_size=4, async_scheduling=False)
    engine = hfpaged.Engine(m)
    if finished == "length":
        target_expected = reference_generate(m, [target_prompt], max_new_tokens=3, do_sample=False)[0]
        target = engine.add_request(target_prompt, max_new_tokens=3, do_sample=False)
    else:
        beam = dict(max_new_tokens=8, do_sample=False, num_beams=2, num_return_sequences=2)
        target = engine.add_request(
            target_prompt, **beam, **({"early_stopping": True} if finished == "beam-end" else {})
        )
    other = engine.add_request(other_prompt, max_new_tokens=3, do_sample=False)
    real, fired = scheduler.Scheduler.finish, []

    def finish(self, request, reason, *args, **kwargs):
        real(self, request, reason, *args, **kwargs)
        if request.prompt_id == target and not fired and (finished != "beam-end" or reason == "stop"):
            fired.append(reason)
            raise KeyboardInterrupt("right after a finish")

    monkeypatch.setattr(scheduler.Scheduler, "finish", finish)
    _, finals, interrupts, _ = run_engine(engine, {target, other})
    assert fired and interrupts == 1 and not engine.has_unfinished()
    assert [o.token_ids for o in finals[other]] == [other_expected]
    if finished == "length":
        assert [(o.finish_reason, o.token_ids) for o in finals[target]] == [("length", target_expected)]
    else:  # the search's one output: the error that cut it short
        assert [o.finish_reason for o in finals[target]] == ["error"] and "right after a finish" in finals[target][
            0
        ].error
    assert all_free(m)
    monkeypatch.undo()
    assert m.generate_many([other_prompt], max_new_tokens=3, do_sample=False)[0].token_ids == other_expected


def test_a_sigint_handler_installed_during_a_step_stays(monkeypatch):
    # a stopping criterion (or a logits processor) that installs its own handler keeps it, as under stock generate;
    # the step's own handler is not what user code sees afterwards (before: the default handler was put back)
    m = make_model("llama", seed=0)
    hfpaged.patch(m, num_blocks=32, block_size=4)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def mine(signum, frame):
        pass

    class InstallsAHandler(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            signal.signal(signal.SIGINT, mine)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    try:
        m.generate_many(random_prompts([5], seed=2), max_new_tokens=3, stopping_criteria=[InstallsAHandler()])
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["internal", "raised-interrupt"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_error_half_way_through_an_update_gives_back_the_unchecked_tokens(async_scheduling, error, monkeypatch):
    # before: the tokens appended before the error went on unchecked after the recovery (a request could run past
    # its length or eos, its stream missed the token). Now an unchecked token is given back and sampled again when
    # the request is recomputed: the error propagates, the streams and results stay exact. (A KeyboardInterrupt
    # raised there by a SIGINT handler of the program's own, which the engine does not hold back, is taken the same
    # way.)
    from hfpaged.core import scheduler

    m, prompts, expected, engine = two_prompts_engine(async_scheduling)
    real, calls = scheduler.check_stops, [0]

    def check_stops(requests, interrupts):
        calls[0] += 1
        if calls[0] == 3:
            raise error("injected in the update")
        return real(requests, interrupts)

    monkeypatch.setattr(scheduler, "check_stops", check_stops)
    ids = [engine.add_request(p, max_new_tokens=5, do_sample=False) for p in prompts]
    streamed, finals, failures, raised = run_engine(engine, set(ids), errors=error)
    assert failures == 1 and "injected in the update" in str(raised)
    assert [[streamed[i]] for i in ids] == [[o.token_ids for o in finals[i]] for i in ids] == [[e] for e in expected]
    assert {o.finish_reason for i in ids for o in finals[i]} == {"length"}
    assert all_free(m)


def test_a_failed_step_does_not_cost_another_caller_its_requests(model, monkeypatch):
    """Caller A's requests are in the engine when caller B's step fails: A's are recomputed, still exact."""
    prompts = random_prompts([6, 13], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    first = hfpaged.Engine(model)
    ids = [first.add_request(p, max_new_tokens=8, do_sample=False) for p in prompts]
    requests = [first.core.scheduler.requests[rid] for rid in ids]
    for _ in range(3):
        first.step()
    assert all(r.output_token_ids for r in requests)  # A is mid-way
    runner = model._hfpaged.engine.runner
    monkeypatch.setattr(runner, "execute", lambda out: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        model.generate_many(random_prompts([7], seed=6), max_new_tokens=4, do_sample=False)
    monkeypatch.undo()
    while first.has_unfinished():
        first.step()
    assert [r.output_token_ids for r in requests] == expected
    assert all_free(model)


# --- weights that change after patch -----------------------------------------------------------------


def stock(m, prompts, **settings):
    return reference_generate(m, prompts, max_new_tokens=8, do_sample=False, **settings)


def test_load_state_dict_after_patch_drops_the_stale_prefix_cache(model):
    prompts = random_prompts([13, 21, 17], seed=7)
    shared = [prompts[0] + p for p in prompts]  # a common prefix: the cache holds its blocks
    assert exact(model, shared) and exact(model, shared)
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0  # the second call reused the first call's blocks
    other = make_model("llama", seed=99)
    model.load_state_dict(other.state_dict())
    assert [r.token_ids for r in model.generate_many(shared, max_new_tokens=8, do_sample=False)] == stock(other, shared)


def test_in_place_updates_and_an_optimizer_step_are_used_by_the_next_call(model):
    prompts = random_prompts([9, 16, 12], seed=8)
    assert exact(model, prompts)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
    assert exact(model, prompts)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        ids = torch.tensor([prompts[1]])
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert exact(model, prompts)


def test_a_replaced_parameter_or_submodule_is_seen_by_the_next_call(model):
    """The weights fingerprint reads remembered submodules: a new Parameter object, a new submodule and a
    tensor's storage swapped under it each count as new weights (cached prefix blocks dropped)."""
    prompts = random_prompts([13, 9], seed=17)
    shared = [prompts[0] + p for p in prompts]
    assert exact(model, shared)
    mlp = model.model.layers[0].mlp  # layer 0: the K/V of layer 1 depend on it (cached prefix blocks go stale)
    torch.manual_seed(5)
    mlp.up_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.up_proj.weight) * 0.3)
    assert exact(model, shared)
    old = mlp.gate_proj
    mlp.gate_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    assert exact(model, shared)
    mlp.down_proj.weight.data = torch.randn_like(mlp.down_proj.weight) * 0.3
    assert exact(model, shared)
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_a_parameter_rebound_at_its_old_address_is_seen_by_the_next_call(model):
    """``param.data = new`` where ``new`` lies at the old address (here: two numpy-backed tensors over one array; the
    allocator can do the same after freeing the old tensor): the address and version counter are unchanged, the
    storage is not, and cached prefix blocks of the old weights must not be reused."""
    prompts = random_prompts([13, 9], seed=17)
    shared = [prompts[0] + p for p in prompts]
    weight = model.model.layers[0].mlp.up_proj.weight  # layer 0: the K/V of layer 1 depend on it
    array = weight.detach().numpy().copy()
    weight.data = torch.from_numpy(array)
    assert exact(model, shared) and exact(model, shared)
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0
    address, version = weight.data_ptr(), weight._version
    rebound = torch.from_numpy(array)  # another storage over the same memory
    torch.manual_seed(3)
    rebound.copy_(torch.randn_like(rebound) * 0.3)  # counted by `rebound`'s version counter, not the weight's
    weight.data = rebound
    assert (weight.data_ptr(), weight._version) == (address, version)
    assert exact(model, shared)


def test_a_buffer_changed_in_place_drops_the_stale_prefix_cache(model):
    # buffers are part of what a model computes (RoPE's inv_freq here): an in-place change counts as new weights
    prompts = random_prompts([13, 9], seed=17)
    shared = [prompts[0] + p for p in prompts]
    assert exact(model, shared) and exact(model, shared)
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0  # the second call reused the first call's blocks
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.5)
    assert exact(model, shared)  # computed again with the new buffer, not served from the old blocks


@pytest.mark.parametrize("extra", [40, -20], ids=["grown", "shrunk"])
def test_resize_token_embeddings_after_patch_is_seen_by_the_next_call(model, extra):
    # the vocabulary is read again with the new embedding: prompts, token lists and penalty tables follow it
    assert exact(model, [[5, 6, 7]], repetition_penalty=1.5)  # the penalty table is sized to the old vocabulary
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(old + extra, mean_resizing=False)
    torch.manual_seed(1)
    with torch.no_grad():
        model.get_input_embeddings().weight[old:].normal_(0, 0.3)
        model.get_output_embeddings().weight[old:].normal_(0, 1.0)
    vocab = old + extra
    prompts = [[t % vocab for t in p] for p in random_prompts([1, 5, 17], seed=2)]
    top = [vocab - 1, vocab - 2]
    assert exact(model, prompts)
    assert exact(model, prompts, suppress_tokens=top, repetition_penalty=1.5)
    assert exact(model, [[5, vocab - 1, 6]], bad_words_ids=[[vocab - 3]])
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {vocab}\\)"):
        model.generate_many([[5, vocab]], max_new_tokens=2)
    assert all_free(model)


def test_weights_changed_while_a_request_runs_never_reach_later_requests_through_the_prefix_cache(model):
    """The running request keeps the K/V it computed with the old weights (documented); when it finishes its
    blocks must not be published, or the next call with the same prompt would reuse old-weight K/V."""
    prompts = random_prompts([20, 7], seed=9)
    assert exact(model, prompts)
    engine = hfpaged.Engine(model)
    engine.add_request(prompts[0], max_new_tokens=30, do_sample=False)
    engine.step()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
    engine.add_request(prompts[1], max_new_tokens=2, do_sample=False)  # the change is noticed while one runs
    while engine.has_unfinished():
        engine.step()
    assert exact(model, prompts)
    assert all_free(model)


def test_reset_prefix_cache_forgets_every_cached_block(model):
    prompts = random_prompts([17, 17], seed=9)
    model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    before = hfpaged.stats(model)["prefix_cache_hits"]
    hfpaged.reset_prefix_cache(model)
    model.generate_many(prompts[:1], max_new_tokens=4, do_sample=False)
    assert hfpaged.stats(model)["prefix_cache_hits"] == before  # nothing left to hit
    model.generate_many(prompts[:1], max_new_tokens=4, do_sample=False)
    assert hfpaged.stats(model)["prefix_cache_hits"] > before


# --- sizing and lifetime ----------------------------------------------------------------------------------


def test_swap_space_defaults_to_the_pool_size_and_is_allocated_at_the_first_swap():
    m = make_model("llama", seed=12)
    hfpaged.patch(m, num_blocks=64, block_size=4, max_num_seqs=4, preemption_mode="swap")
    st = hfpaged.stats(m)
    assert st["num_cpu_blocks"] == 64
    assert m._hfpaged.swap.caches == []  # nothing allocated yet
    hfpaged.patch(m, num_blocks=26, block_size=4, max_num_seqs=3, max_num_batched_tokens=24, preemption_mode="swap")
    prompts = random_prompts([1, 3, 9, 17, 33, 64, 5, 40], seed=1)
    assert exact(m, prompts)
    assert hfpaged.stats(m)["num_swapped_out"] > 0 and len(m._hfpaged.swap.caches) == 2
    assert all_free(m)


@pytest.mark.parametrize("gemv", [None, True], ids=["default", "gemv"])
def test_deleting_the_model_frees_the_pool_without_a_garbage_collection(gemv):
    # gemv: the GEMV's projections include the output embedding, whose parent is the model itself
    m = make_model("llama", seed=13, dtype=torch.float16 if gemv else torch.float32)
    hfpaged.patch(m, num_blocks=32, block_size=4, gemv=gemv)
    m.generate_many(random_prompts([5, 9], seed=1), max_new_tokens=4, do_sample=True, seed=1)
    list(m.stream_many(random_prompts([5], seed=2), max_new_tokens=3))
    caches = weakref.ref(m._hfpaged.kv_caches[0][0])
    engine = weakref.ref(m._hfpaged.engine)
    gc.collect()
    gc.disable()
    try:
        del m
        assert caches() is None and engine() is None
    finally:
        gc.enable()


def test_calls_leave_no_hfpaged_object_to_the_cycle_collector():
    # each step's Ctrl-C deferral referred to itself through its handler (a bound method): a cycle per step, for
    # the collector passes that freeze_gc exists to avoid
    m = make_model("llama", seed=13)
    hfpaged.patch(m, num_blocks=32, block_size=4)
    prompts = random_prompts([5, 9], seed=1)
    m.generate_many(prompts, max_new_tokens=4)

    def calls():
        m.generate_many(prompts, max_new_tokens=6)
        list(m.stream_many(prompts, max_new_tokens=3))

    assert hfpaged_cyclic_garbage(calls) == []


@pytest.mark.parametrize(
    "settings",
    [dict(num_beams=3, num_return_sequences=2, do_sample=False), dict(num_return_sequences=3, do_sample=True, seed=1)],
    ids=["beam_search", "samples"],
)
def test_prompts_of_several_sequences_leave_no_hfpaged_object_to_the_cycle_collector(settings):
    # a prompt's group held its sequences and each sequence its group: a cycle per prompt of num_beams > 1 or
    # num_return_sequences > 1, keeping its requests (and beam search) until a collector pass. Finished, aborted,
    # through generate_many, stream_many and an Engine handle.
    m = make_model("llama", seed=13)
    hfpaged.patch(m, num_blocks=64, block_size=4)
    prompts = random_prompts([5, 9], seed=1)
    expected = [r.sequences for r in m.generate_many(prompts, max_new_tokens=6, **settings)]
    got = []

    def calls():
        got.append([r.sequences for r in m.generate_many(prompts, max_new_tokens=6, **settings)])
        if not settings.get("num_beams"):  # (streams do not take beam search)
            list(m.stream_many(prompts, max_new_tokens=3, **settings))
        engine = hfpaged.Engine(m)
        kept, dropped = (engine.add_request(prompt, max_new_tokens=6, **settings) for prompt in prompts)
        engine.step()
        engine.abort(dropped)
        while engine.has_unfinished():
            engine.step()

    assert hfpaged_cyclic_garbage(calls) == []
    assert [[s.token_ids for s in r] for r in got[0]] == [[s.token_ids for s in r] for r in expected]
    assert all_free(m)


def hfpaged_cyclic_garbage(run) -> list[str]:
    """The types of the hfpaged objects that ``run()`` leaves to the cycle collector (collector off meanwhile)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("hfpaged")]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


class _CtrlCOnce(LogitsProcessor):
    """A Ctrl-C in the middle of a step (held until the step is done), once."""

    def __init__(self):
        self.sent = False

    def __call__(self, input_ids, scores):
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGINT)
        return scores


def test_a_held_ctrl_c_leaves_no_hfpaged_object_to_the_cycle_collector():
    # the raised KeyboardInterrupt's traceback holds the frames that raised it, and their locals held it: a cycle per
    # interrupt, keeping the call's client, requests and step objects until a collector pass
    m = make_model("llama", seed=13)
    hfpaged.patch(m, num_blocks=32, block_size=4)
    prompts = random_prompts([5, 9], seed=1)

    def interrupted():
        with pytest.raises(KeyboardInterrupt):
            m.generate_many(prompts, max_new_tokens=6, logits_processor=[_CtrlCOnce()])

    assert hfpaged_cyclic_garbage(interrupted) == []
    assert all_free(m) and exact(m, prompts)


def test_a_second_ctrl_c_during_the_cleanup_still_aborts_every_prompt(monkeypatch):
    # a Ctrl-C between steps ends generate_many, whose cleanup aborts its prompts one by one; a second one during the
    # first abort was raised when that abort ended: the other prompts ran on, owned by the engine, while the
    # exception (and so the call's client) was kept, as an interactive session keeps it
    import hfpaged.engine as engine_module

    m = make_model("llama", seed=13)
    hfpaged.patch(m, num_blocks=64, block_size=4)
    prompts = random_prompts([5, 7, 9, 6], seed=1)
    steps, aborts = [0], [0]
    step, abort = engine_module.Client.step, engine_module.EngineCore.abort

    def step_then_ctrl_c(self):
        steps[0] += 1
        if steps[0] == 3:
            signal.raise_signal(signal.SIGINT)  # between steps: raised at once
        return step(self)

    def abort_with_ctrl_c(self, prompt_id):
        aborts[0] += 1
        if aborts[0] == 1:
            signal.raise_signal(signal.SIGINT)  # during the first abort
        return abort(self, prompt_id)

    monkeypatch.setattr(engine_module.Client, "step", step_then_ctrl_c)
    monkeypatch.setattr(engine_module.EngineCore, "abort", abort_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as raised:  # kept: its traceback holds the call's client
        m.generate_many(prompts, max_new_tokens=50)
    assert aborts[0] == len(prompts) and not engine_module.engine_of(m).owners
    monkeypatch.undo()
    assert raised.value is not None and all_free(m) and exact(m, prompts)


# --- malformed input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts,error,message",
    [
        (5, TypeError, "prompts must be a list of prompts .* got int"),
        (None, TypeError, "prompts must be a list of prompts .* got NoneType"),
        (
            [torch.tensor([3.0, 4.5])],
            TypeError,
            "prompt 0 is a Tensor of dtype torch.float32; token ids must be integers",
        ),
        ([np.array([3.0, 4.0])], TypeError, "prompt 0 is a ndarray of dtype float64"),
        (torch.tensor([[3.0, 4.0]]), TypeError, "prompts is a Tensor of dtype torch.float32"),
        (torch.zeros(2, 2, 2, dtype=torch.long), ValueError, "3-D Tensor of shape"),
        ([object()], TypeError, "prompt 0 has unsupported type object"),
    ],
)
def test_malformed_prompts_name_what_was_wrong(model, prompts, error, message):
    with pytest.raises(error, match=message):
        model.generate_many(prompts, max_new_tokens=4)
    assert all_free(model) and exact(model, random_prompts([4], seed=3))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(logit_bias={5: float("nan")}), "logit_bias must be a dict of token id .* finite float"),
        (dict(logit_bias={5: float("inf")}), "logit_bias must be a dict of token id .* finite float"),
        (dict(return_dict_in_generate=True), "return_dict_in_generate=True .* GenerationResult"),
        (dict(attention_mask=torch.ones(1, 4)), "attention_mask= .* 2-D batch"),
        # stock raises a bare IndexError when it applies them (the last step): refused before anything runs
        (dict(forced_eos_token_id=500), r"prompt 0: forced_eos_token_id=500 is outside the vocabulary \[0, 96\)"),
        (dict(forced_bos_token_id=-1), r"prompt 0: forced_bos_token_id=-1 is outside the vocabulary"),
        (dict(forced_eos_token_id=[3, 96]), r"forced_eos_token_id=\[3, 96\] is outside the vocabulary"),
    ],
)
def test_malformed_settings_name_what_was_wrong(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate_many(random_prompts([4], seed=3), max_new_tokens=4, **kwargs)
    assert all_free(model)


def test_naming_a_prompt_keeps_errors_it_cannot_rebuild_as_they_are():
    from hfpaged.prompt_forms import naming_prompt

    class TwoArguments(ValueError):
        def __init__(self, message, code):
            super().__init__(message)
            self.code = code

    cause = KeyError("k")
    with pytest.raises(TwoArguments) as raised, naming_prompt(2, True):
        raise TwoArguments("bad value", 7) from cause
    assert raised.value.code == 7 and raised.value.__cause__ is cause  # not rebuilt: its cause and fields kept
    with pytest.raises(ValueError, match=r"^prompt 2 has 3 tokens$"), naming_prompt(2, True):
        raise ValueError("the prompt has 3 tokens")
    with pytest.raises(ValueError, match=r"^prompt 2: x=1 is wrong$"), naming_prompt(2, True):
        raise ValueError("the prompt: x=1 is wrong")


def test_numpy_prompts_and_2d_batches_work_like_tensors(model):
    prompts = random_prompts([6, 6, 6], seed=10)
    expected = stock(model, prompts)
    assert [
        r.token_ids for r in model.generate_many([np.array(p) for p in prompts], max_new_tokens=8, do_sample=False)
    ] == expected
    assert [
        r.token_ids
        for r in model.generate_many([np.array(p, dtype=np.int32) for p in prompts], max_new_tokens=8, do_sample=False)
    ] == expected
    for batch in (torch.tensor(prompts), np.array(prompts)):
        assert [r.token_ids for r in model.generate_many(batch, max_new_tokens=8, do_sample=False)] == expected


def test_a_padded_2d_batch_needs_its_attention_mask(model):
    model.generation_config.pad_token_id = 0
    prompts = random_prompts([3, 6], seed=11)
    batch = torch.tensor([[0, 0, 0] + prompts[0], prompts[1]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    with pytest.raises(ValueError, match=r"prompt 0 holds the pad token id 0 at positions \[0, 1, 2\]: generate would"):
        model.generate_many(batch, max_new_tokens=8, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # left padding, as generate wants it: no warning
        got = [r.token_ids for r in model.generate_many(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)]
    assert got == stock(model, prompts)
    right = torch.tensor([prompts[0] + [0, 0, 0], prompts[1]])
    with pytest.warns(UserWarning, match="padding after tokens"):
        got = model.generate_many(right, attention_mask=mask.flip(1), max_new_tokens=8, do_sample=False)
    assert [r.token_ids for r in got] == stock(model, prompts)  # each row unpadded (generate would differ)
    assert all_free(model)


def test_prompts_holding_the_pad_token_are_refused_where_generate_would_mask_them(model):
    """Without an attention mask generate masks every position holding pad_token_id (when it is set and is not an
    eos id); generate_many would attend to them, so it refuses them, wherever the pad id comes from (the model's
    config, a call's keyword or its GenerationConfig: found by a probe in session 30, when only the model's config
    was read and a per-call pad id gave other tokens silently), and for lists and 1-D tensors as for 2-D rows."""
    model.generation_config.pad_token_id = None
    prompts = random_prompts([5, 7], seed=13)
    padded = [[0, 0] + prompts[0], prompts[1][:3] + [0] + prompts[1][3:]]
    refused = r"prompt 0 holds the pad token id 0 at positions \[0, 1\]"
    with pytest.raises(ValueError, match=refused):
        model.generate_many(torch.tensor([padded[0], prompts[1][:4] + [9, 9, 9]]), pad_token_id=0, max_new_tokens=4)
    with pytest.raises(ValueError, match=refused):
        model.generate_many(padded, generation_config=GenerationConfig(pad_token_id=0, max_new_tokens=4))
    with pytest.raises(ValueError, match=r"prompt 0 holds the pad token id 0 at positions \[3\]"):
        model.generate_many([torch.tensor(padded[1])], pad_token_id=0, max_new_tokens=4)
    assert all_free(model)
    # pad_token_id None (generate then pads with eos and infers no mask), or a pad id that is an eos: read as tokens
    model.generation_config.pad_token_id = 0
    for settings in (dict(pad_token_id=None), dict(eos_token_id=[0, 1]), dict(eos_token_id=torch.tensor([1, 0]))):
        expected = stock(model, padded, **settings)
        got = model.generate_many(padded, max_new_tokens=8, do_sample=False, **settings)
        assert [r.token_ids for r in got] == expected, settings
    # rows whose padding an attention_mask removed keep a real token equal to the pad id, as generate does
    row, mask = [0, 0, 0, 11, 0, 12], [0, 0, 0, 1, 1, 1]
    with torch.no_grad():
        want = model.generate(
            torch.tensor([row]), attention_mask=torch.tensor([mask]), max_new_tokens=8, do_sample=False
        )
    got = model.generate_many(
        torch.tensor([row]), attention_mask=torch.tensor([mask]), max_new_tokens=8, do_sample=False
    )
    assert got[0].token_ids == want[0, len(row) :].tolist() and got[0].prompt_token_ids == [11, 0, 12]
    assert all_free(model)


def test_a_prompts_own_bad_settings_name_the_prompt(model):
    """Settings given to one prompt (a dict prompt, a list of configs) name it in the error; the call's own settings
    name only the argument (they are every prompt's). Nothing runs either way."""
    prompts = random_prompts([4, 5], seed=14)
    cases = [
        ([prompts[0], {"prompt": prompts[1], "temperature": "hot", "do_sample": True}], {}, "prompt 1: temperature"),
        ([prompts[0], {"prompt": prompts[1], "max_new_tokens": -2}], {}, "prompt 1: .*max_new_tokens"),
        ([prompts[0], {"prompt": prompts[1], "top_logprobs": -1}], {}, "prompt 1: top_logprobs"),
        (
            prompts,
            {"generation_config": [GenerationConfig(), GenerationConfig(top_p=2.0, do_sample=True)]},
            "prompt 1: top_p",
        ),
        (prompts, {"top_k": -3, "do_sample": True}, "^top_k must be"),
    ]
    for entries, settings, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate_many(entries, **{"max_new_tokens": 3, **settings})
    assert all_free(model)


def test_min_new_tokens_beyond_max_new_tokens_warns_as_generate_does(model):
    prompt = random_prompts([5], seed=12)
    with pytest.warns(UserWarning, match="Unfeasible length constraints: `min_new_tokens` \\(9\\)") as stock_warnings:
        model.generate(torch.tensor(prompt), max_new_tokens=4, min_new_tokens=9, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate_many(prompt * 3, max_new_tokens=4, min_new_tokens=9, do_sample=False)
    ours = [str(w.message) for w in caught if "Unfeasible length constraints" in str(w.message)]
    theirs = [str(w.message) for w in stock_warnings if "Unfeasible length constraints" in str(w.message)]
    assert ours == theirs and len(ours) == 2  # stock's messages, once per call (not once per prompt)


def test_a_streamer_whose_end_raises_does_not_hide_the_original_error(model, monkeypatch):
    class BrokenEnd(TextStreamer):
        def end(self):
            raise OSError("the streamer's pipe is closed")

    class Tok:
        def decode(self, ids, **kwargs):
            return "x" * len(ids)

    runner = model._hfpaged.engine.runner
    monkeypatch.setattr(runner, "execute", lambda out: (_ for _ in ()).throw(RuntimeError("the real failure")))
    with pytest.raises(RuntimeError, match="the real failure") as info:
        model.generate_many(random_prompts([5], seed=13), max_new_tokens=4, streamer=BrokenEnd(Tok()))
    assert any("the streamer's pipe is closed" in note for note in info.value.__notes__)
    monkeypatch.undo()
    assert all_free(model)


def test_numpy_eos_ids_are_taken_as_generate_takes_them(model):
    """numpy integers and integer arrays as ``eos_token_id`` (per call and per prompt), as stock takes them; a
    float or a bool is still refused by name."""
    prompts = random_prompts([7, 5], seed=2)
    free = stock(model, prompts)
    a, b = free[0][3], free[1][-2]
    for eos in (np.int64(a), np.array([a, b]), [np.int32(b)]):
        want = stock(model, prompts, eos_token_id=eos)
        assert want == stock(model, prompts, eos_token_id=torch.tensor(eos).tolist())
        assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=8, eos_token_id=eos)] == want
        dicts = [{"prompt": p, "eos_token_id": eos} for p in prompts]
        assert [r.token_ids for r in model.generate_many(dicts, max_new_tokens=8)] == want
    for bad in (float(a), True):
        with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
            model.generate_many(prompts, max_new_tokens=8, eos_token_id=bad)
    assert all_free(model)


@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused"])
def test_a_fused_optimizer_step_drops_the_stale_prefix_cache(model, optimizer):
    """Fused optimizers (AdamW(fused=True): the Trainer's default on recent torch) write parameters without bumping
    their version counters; a probe found later prompts then hit prefix blocks of the old weights."""
    prompts = random_prompts([13, 9], seed=17)
    shared = [prompts[0] + p for p in prompts]
    assert exact(model, shared) and exact(model, shared)
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw-fused":
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=0.5, fused=True)
    versions = [p._version for p in params]
    model.train()
    model(torch.tensor([shared[0]]), labels=torch.tensor([shared[0]])).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    assert [p._version for p in params] == versions  # what the version counters alone miss
    assert exact(model, shared)
    assert all_free(model)


def test_two_models_sharing_attention_modules_are_refused_until_the_first_is_unpatched():
    """``c.model = b.model`` (one backbone, two heads): patching both bound the shared modules to c's pool while b's
    engine kept its own block allocator, and a probe saw b's steps overwrite c's cached prefix blocks."""
    b, c = make_model("llama"), make_model("llama", seed=5)
    c.model = b.model
    hfpaged.patch(b, num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="belongs to another patched model too"):
        hfpaged.patch(c, num_blocks=32, block_size=4)
    assert not hasattr(c, "_hfpaged")
    prompts = random_prompts([9], seed=3)
    assert [r.token_ids for r in b.generate_many(prompts, max_new_tokens=6)] == stock_of(b, prompts)
    hfpaged.patch(b, num_blocks=24, block_size=4)  # patching the same model again is fine
    hfpaged.unpatch(b)
    hfpaged.patch(c, num_blocks=32, block_size=4)
    assert [r.token_ids for r in c.generate_many(prompts, max_new_tokens=6)] == stock_of(c, prompts)


def stock_of(m, prompts):
    return reference_generate(m, prompts, max_new_tokens=6, do_sample=False)


@pytest.mark.parametrize("how", ["unpatch", "patch again"])
def test_an_engine_handle_of_an_unpatched_model_says_so(how):
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=32, block_size=4)
    engine = hfpaged.Engine(model)
    if how == "unpatch":
        hfpaged.unpatch(model)
    else:
        hfpaged.patch(model, num_blocks=24, block_size=4)
    with pytest.raises(RuntimeError, match="model was unpatched or patched again: make a new one"):
        engine.add_request([5, 6, 7], max_new_tokens=3)
    assert engine.step() == [] and not engine.has_unfinished()
