"""A ``generate_many`` on the same model from inside one of its own steps (a logits processor generating with it).

The enclosing step's requests keep their blocks and sequence slots until that step ends, which it cannot before
the nested call returns. Until session 40 a nested prompt that needed room only they held either failed the whole
outer call with "scheduler made no progress" (``max_num_seqs`` full) or was preempted and re-admitted without end
(a pool too small for both: a hang at 100% CPU). Now it fails alone, with an error naming the room it lacks, and
the outer requests go on exact; with room the nested call is exact as before."""

import re

import pytest
import torch
from models import make_model, random_prompts, reference_generate
from transformers import LogitsProcessor, StoppingCriteria

import hfpaged
from hfpaged.core import scheduler as scheduler_module

OUTER = [[11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
INNER = [31, 32, 33, 34, 35, 36, 37, 38, 39, 40]
NESTED_ERROR = r"prompt 0 cannot run inside a step of the same model .* Patch with more num_blocks or max_num_seqs"

# (patch options, whether the nested prompt fits beside the outer step's requests)
CASES = {
    "room": (dict(num_blocks=64, block_size=4, max_num_seqs=3), True),
    "slots taken": (dict(num_blocks=64, block_size=4, max_num_seqs=2), False),
    "blocks taken, recompute": (dict(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=4), False),
    "blocks taken, swap": (
        dict(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=4, preemption_mode="swap"),
        False,
    ),
}


def all_free(m):
    st = hfpaged.stats(m)
    return st["num_free_blocks"] == st["num_blocks"] and st["num_free_cpu_blocks"] == st["num_cpu_blocks"]


class Nested(LogitsProcessor):
    """At each of its prompt's steps, generates with the same model; records what came back or what it raised."""

    def __init__(self, model, catch, prompt=INNER, **settings):
        self.model, self.catch, self.prompt, self.results = model, catch, prompt, []
        self.settings = settings or dict(max_new_tokens=5, do_sample=False)

    def __call__(self, input_ids, scores):
        try:
            out = self.model.generate_many([self.prompt], **self.settings)
            self.results.append(
                out[0].token_ids if len(out[0].sequences) == 1 else [s.token_ids for s in out[0].sequences]
            )
        except RuntimeError as error:
            if not self.catch:
                raise
            self.results.append(error)
        return scores


class NestingStop(StoppingCriteria):
    """A stopping criterion that generates with the same model (through ``nested``) and stops nothing."""

    def __init__(self, nested):
        self.nested = nested

    def __call__(self, input_ids, scores, **kwargs):
        self.nested(input_ids, scores)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture
def no_livelock(monkeypatch):
    """Fails a test whose scheduler preempts without end (the hang this file is about) instead of hanging it."""
    original, count = scheduler_module.Scheduler._preempt_one, [0]

    def counted(self, *args, **kwargs):
        count[0] += 1
        if count[0] > 500:
            raise AssertionError("more than 500 preemptions: a nested request is re-admitted without end")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(scheduler_module.Scheduler, "_preempt_one", counted)


@pytest.mark.parametrize("case", CASES)
def test_a_nested_generation_fails_alone_when_the_steps_requests_hold_its_room(case, no_livelock):
    options, fits = CASES[case]
    model = make_model("llama", seed=7)
    expected_outer = reference_generate(model, OUTER, max_new_tokens=8, do_sample=False)
    expected_inner = reference_generate(model, [INNER], max_new_tokens=5, do_sample=False)[0]
    hfpaged.patch(model, **options)
    nested = Nested(model, catch=True)
    got = model.generate_many(
        [dict(prompt=OUTER[0], logits_processor=[nested]), OUTER[1]], max_new_tokens=8, do_sample=False
    )
    assert [r.token_ids for r in got] == expected_outer  # the outer call is exact either way
    assert len(nested.results) == 8  # one nested call per outer step of that prompt
    failures = [r for r in nested.results if isinstance(r, RuntimeError)]
    # (the pool cases: the first steps' outer sequences are short enough to leave the nested prompt room)
    assert [r for r in nested.results if r not in failures] == [expected_inner] * (8 - len(failures))
    assert all(re.search(NESTED_ERROR, str(error)) for error in failures)
    assert bool(failures) == (not fits)
    assert all(("max_num_seqs=2 until" in str(error)) == (case == "slots taken") for error in failures)
    assert len(failures) == 8 or case != "slots taken"
    assert all_free(model)
    assert [r.token_ids for r in model.generate_many([INNER], max_new_tokens=5, do_sample=False)] == [expected_inner]


def test_an_uncaught_nested_failure_fails_its_outer_prompt_alone(no_livelock):
    # the processor lets the error through: its outer prompt fails with it (a processor's error is its prompt's),
    # while an Engine handle's other prompt in the same steps goes on, exact
    model = make_model("llama", seed=7)
    expected_outer = reference_generate(model, OUTER, max_new_tokens=8, do_sample=False)
    hfpaged.patch(model, **CASES["blocks taken, recompute"][0])
    with pytest.raises(RuntimeError, match=NESTED_ERROR):
        model.generate_many(
            [dict(prompt=OUTER[0], logits_processor=[Nested(model, catch=False)]), OUTER[1]], max_new_tokens=8
        )
    assert all_free(model)
    hfpaged.reset_prefix_cache(model)  # (the nested prompt's cached blocks would give it the room it lacked)
    engine = hfpaged.Engine(model)
    failing = engine.add_request(OUTER[0], max_new_tokens=8, do_sample=False, logits_processor=[Nested(model, False)])
    other = engine.add_request(OUTER[1], max_new_tokens=8, do_sample=False)
    finals = {}
    while engine.has_unfinished():
        finals.update({o.prompt_id: o for o in engine.step() if o.finished})
    assert finals[failing].finish_reason == "error" and "cannot run inside a step" in finals[failing].error
    assert finals[other].token_ids == expected_outer[1]
    assert all_free(model)
    prompts = random_prompts([5, 8], seed=3)
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6, do_sample=False)] == (
        reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    )


def test_a_nested_prompt_waits_for_an_outer_prompt_that_is_still_prefilling(no_livelock):
    # the outer call's long prompt is mid-prefill when the nested call starts (its chunk was in the enclosing step,
    # but it samples nothing there): it moves on in the nested steps and frees its room when it finishes, so the
    # nested prompt waits for it (preempted once) instead of failing. A first version of the change failed it.
    model = make_model("llama", seed=7)
    short, long = random_prompts([3, 40], seed=1)
    inner = random_prompts([10], seed=2)[0]
    expected_outer = reference_generate(model, [short, long], max_new_tokens=3, do_sample=False)
    expected_inner = reference_generate(model, [inner], max_new_tokens=3, do_sample=False)[0]
    hfpaged.patch(model, num_blocks=14, block_size=4, max_num_batched_tokens=8, async_scheduling=False)
    results = []

    class Nested(LogitsProcessor):
        def __call__(self, input_ids, scores):
            results.append(model.generate_many([inner], max_new_tokens=3, do_sample=False)[0].token_ids)
            return scores

    got = model.generate_many([dict(prompt=short, logits_processor=[Nested()]), long], max_new_tokens=3)
    assert [r.token_ids for r in got] == expected_outer
    assert results == [expected_inner] * 3
    assert hfpaged.stats(model)["num_preemptions"] > 0  # it did wait for room
    assert all_free(model)


def test_an_outer_prompt_waiting_for_a_slot_is_not_failed_in_the_nested_ones_place(no_livelock):
    # three outer prompts and max_num_seqs=2: the third waits for a slot while the nested calls run. A first version
    # failed it with the nested error (the first queued request), and with it the whole outer call; nested prompts
    # now queue ahead of the enclosing calls' waiting ones, and only they fail
    model = make_model("llama", seed=7)
    outer = [[11, 12, 13], [21, 22, 23, 24], [41, 42, 43, 44, 45]]
    expected = reference_generate(model, outer, max_new_tokens=4, do_sample=False)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=2)
    nested = Nested(model, catch=True)
    got = model.generate_many(
        [dict(prompt=outer[0], logits_processor=[nested]), *outer[1:]], max_new_tokens=4, do_sample=False
    )
    assert [r.token_ids for r in got] == expected
    assert len(nested.results) == 4 and all(re.search(NESTED_ERROR, str(error)) for error in nested.results)
    assert all_free(model)


@pytest.mark.parametrize("num_blocks", [7, 9])
def test_a_nested_beam_search_fails_whole_or_is_exact(num_blocks, no_livelock):
    # a nested beam search whose beams need a block each beside the outer step's sequences: a first version failed
    # the beams after one had been granted its rows in the same step (a KeyError that ended the outer call)
    model = make_model("llama", seed=7)
    inner = [31, 32, 33, 34, 35, 36, 37]
    beams = dict(max_new_tokens=6, do_sample=False, num_beams=2)
    expected_outer = reference_generate(model, OUTER, max_new_tokens=4, do_sample=False)
    expected_beams = reference_generate(model, [inner], **beams)[0]
    hfpaged.patch(model, num_blocks=num_blocks, block_size=4, max_num_seqs=8)
    nested = Nested(model, catch=True, prompt=inner, **beams)
    got = model.generate_many(
        [dict(prompt=OUTER[0], logits_processor=[nested]), OUTER[1]], max_new_tokens=4, do_sample=False
    )
    assert [r.token_ids for r in got] == expected_outer
    failures = [r for r in nested.results if isinstance(r, RuntimeError)]
    assert failures and all(re.search(NESTED_ERROR, str(e)) and "needs 2 more sequence(s)" in str(e) for e in failures)
    assert [r for r in nested.results if r not in failures] == [expected_beams] * (4 - len(failures))
    assert all_free(model)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_stopping_criterion_that_generates_with_the_same_model_is_exact(async_scheduling, no_livelock):
    # stop checks run after the enclosing step's tokens are appended: nested steps scheduled those requests again
    # (they ran on inside the nested call and re-entered their own criterion: 34 tokens for 4, or a RecursionError)
    # and, with overlapped steps, the nested steps' results replaced the one the next step reads its tokens from
    # (wrong tokens). Now a nested step leaves them alone and is never overlapped, and the step restores its result.
    model = make_model("llama", seed=7)
    expected_outer = reference_generate(model, OUTER, max_new_tokens=4, do_sample=False)
    expected_inner = reference_generate(model, [INNER], max_new_tokens=5, do_sample=False)[0]
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=8, async_scheduling=async_scheduling)
    nested = Nested(model, catch=False)
    got = model.generate_many(
        [dict(prompt=OUTER[0], stopping_criteria=[NestingStop(nested)]), OUTER[1]], max_new_tokens=4, do_sample=False
    )
    assert [r.token_ids for r in got] == expected_outer
    assert nested.results == [expected_inner] * 4
    assert all_free(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["processor", "stopping criterion"])
def test_gpu_a_nested_generation_with_cuda_graphs_is_exact(where):
    # default options on CUDA: the outer and the nested steps replay CUDA graphs whose outputs (logits, greedy picks)
    # live in buffers every replay of a bucket writes; the nested steps run while the outer step's logits are in use
    model = make_model("llama", seed=3).cuda()
    outer = random_prompts([3, 17, 9, 33, 5], seed=5)
    inner = random_prompts([6, 21], seed=6)
    expected_outer = reference_generate(model, outer, max_new_tokens=10, do_sample=False)
    expected_inner = reference_generate(model, inner, max_new_tokens=7, do_sample=False)
    hfpaged.patch(model, num_blocks=256, block_size=4, max_num_seqs=16)
    results = []

    def nest():
        results.append([r.token_ids for r in model.generate_many(inner, max_new_tokens=7, do_sample=False)])

    class NestingProcessor(LogitsProcessor):
        def __call__(self, input_ids, scores):
            nest()
            return scores

    class Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            nest()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    hook = {"logits_processor": [NestingProcessor()]} if where == "processor" else {"stopping_criteria": [Stop()]}
    got = model.generate_many(
        [dict(prompt=outer[1], **hook), *outer[:1], *outer[2:]], max_new_tokens=10, do_sample=False
    )
    assert [r.token_ids for r in got] == [expected_outer[1], expected_outer[0], *expected_outer[2:]]
    assert results == [expected_inner] * 10
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]
    assert [r.token_ids for r in model.generate_many(outer, max_new_tokens=10, do_sample=False)] == expected_outer


def test_an_outer_prompt_needing_room_in_a_nested_step_waits_and_the_nested_one_runs(no_livelock):
    # the outer call's second prompt prefills in chunks inside the nested steps and runs out of blocks there. A second
    # version failed it with the nested call's error (the whole outer call raised); it is preempted instead, behind
    # the nested prompt, which runs exact, and itself a step later (a step that only preempted admits nothing:
    # not a reason to fail the nested prompt either)
    model = make_model("llama", seed=7)
    a, b, inner = [11, 12, 13], list(range(40, 49)), [31, 32, 33, 34, 35]
    settings = dict(max_new_tokens=5, do_sample=False)
    expected_outer = reference_generate(model, [a, b], **settings)
    expected_inner = reference_generate(model, [inner], **settings)[0]
    hfpaged.patch(model, num_blocks=8, block_size=2, max_num_seqs=4, max_num_batched_tokens=3, async_scheduling=False)
    nested = Nested(model, catch=True, prompt=inner, **settings)
    calls = []

    def second_call_only(input_ids, scores):
        calls.append(1)
        return nested(input_ids, scores) if len(calls) == 2 else scores

    got = model.generate_many([dict(prompt=a, logits_processor=[second_call_only]), b], **settings)
    assert [r.token_ids for r in got] == expected_outer
    assert nested.results == [expected_inner]
    assert all_free(model)


def test_a_swapped_outer_prompt_does_not_keep_a_nested_one_out(no_livelock):
    # swapped requests come back before waiting ones join; an outer prompt swapped out cannot come back while the
    # enclosing step's sequences keep their blocks, and a second version failed the nested prompt behind it
    model = make_model("llama", seed=7)
    first, second, inner = [11, 12, 13], list(range(40, 54)), [31, 32, 33]
    expected_outer = reference_generate(model, [first, second], max_new_tokens=8, do_sample=False)
    expected_inner = reference_generate(model, [inner], max_new_tokens=2, do_sample=False)[0]
    hfpaged.patch(model, num_blocks=11, block_size=2, max_num_seqs=4, preemption_mode="swap", async_scheduling=False)
    scheduler = hfpaged.model.attach.get_state(model).engine.scheduler
    nested = Nested(model, catch=True, prompt=inner, max_new_tokens=2, do_sample=False)

    def while_one_is_swapped(input_ids, scores):
        return nested(input_ids, scores) if scheduler.swapped and not nested.results else scores

    got = model.generate_many([dict(prompt=first, logits_processor=[while_one_is_swapped]), second], max_new_tokens=8)
    assert [r.token_ids for r in got] == expected_outer
    assert nested.results == [expected_inner]
    assert all_free(model)


def failing_next_step(model, monkeypatch):
    """The runner's next non-empty step raises a (simulated) out-of-memory error once the returned list holds an item."""
    runner = hfpaged.model.attach.get_state(model).engine.runner
    execute, fail_next = runner.execute, []

    def failing_execute(out):
        if fail_next and not out.is_empty:
            fail_next.clear()
            raise torch.OutOfMemoryError("simulated")
        return execute(out)

    monkeypatch.setattr(runner, "execute", failing_execute)
    return fail_next


@pytest.mark.parametrize("beams", [False, True], ids=["greedy", "beams"])
def test_a_failed_nested_step_fails_the_enclosing_step_too(beams, monkeypatch):
    # a nested step that fails (out of memory here) resets every request, the enclosing step's too (its beam rounds
    # rolled back): the outer beam searches came out wrong when the processor caught the nested error. Now the
    # enclosing step fails with an error that names the nested one, and everything is recomputed or reported
    model = make_model("llama", seed=7)
    prompts = random_prompts([3, 5, 7], seed=1)
    settings = dict(max_new_tokens=6, do_sample=False, **(dict(num_beams=2) if beams else {}))
    expected = reference_generate(model, prompts, **settings)
    hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=8)
    fail_next, caught = failing_next_step(model, monkeypatch), []

    def nest_once(input_ids, scores):
        if not caught:
            fail_next.append(True)
            with pytest.raises(torch.OutOfMemoryError) as error:
                model.generate_many([[31, 32, 33]], max_new_tokens=2, do_sample=False)
            caught.append(error.value)  # caught: the enclosing step must not go on as if nothing happened
        return scores

    with pytest.raises(RuntimeError, match="a generate_many nested in this step .* failed with OutOfMemoryError"):
        model.generate_many([dict(prompt=prompts[0], logits_processor=[nest_once]), *prompts[1:]], **settings)
    assert len(caught) == 1 and all_free(model)
    monkeypatch.undo()
    assert [r.token_ids for r in model.generate_many(prompts, **settings)] == expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_nested_step_failing_in_a_stopping_criterion_leaves_the_outer_greedy_call_exact(
    async_scheduling, monkeypatch
):
    # the nested call fails in the enclosing step's last update (its stop checks): the reset requeued every request
    # with the tokens it had, and the step in flight (overlapped) is dropped, its tokens sampled again
    model = make_model("llama", seed=7)
    prompts = random_prompts([3, 5, 7], seed=1)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=8, async_scheduling=async_scheduling)
    fail_next, caught = failing_next_step(model, monkeypatch), []

    class NestOnce(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if not caught:
                fail_next.append(True)
                with pytest.raises(torch.OutOfMemoryError) as error:
                    model.generate_many([[31, 32, 33]], max_new_tokens=2, do_sample=False)
                caught.append(error.value)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    got = model.generate_many(
        [dict(prompt=prompts[0], stopping_criteria=[NestOnce()]), *prompts[1:]], max_new_tokens=6, do_sample=False
    )
    assert [r.token_ids for r in got] == expected and len(caught) == 1
    assert all_free(model)


def test_a_nested_prompt_swapped_out_comes_back_before_the_enclosing_calls_swapped_ones(no_livelock):
    # swap mode: an enclosing call's prompt, still prefilling, preempted the nested prompt (swapped out behind the
    # enclosing calls' swapped prompts, which cannot come back before the enclosing step ends): a fourth version
    # then failed the nested prompt, which fit. A nested call's swapped prompts now queue first
    model = make_model("llama", seed=7)
    outer = [[16, 11, 51, 94, 65, 69, 93, 47, 73], [40, 5, 37, 81], [95, 40, 45, 22, 17, 59, 75, 25]]
    inner = [[78, 61, 35], [57, 16], [34, 64]]
    expected_outer = reference_generate(model, outer, max_new_tokens=4, do_sample=False)
    expected_inner = reference_generate(model, inner, max_new_tokens=2, do_sample=False)
    options = dict(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=4, preemption_mode="swap")
    hfpaged.patch(model, **options, async_scheduling=True)
    results = []

    def nest(input_ids, scores):
        results.append([r.token_ids for r in model.generate_many(inner, max_new_tokens=2, do_sample=False)])
        return scores

    engine = hfpaged.Engine(model)
    ids = [engine.add_request(outer[0], max_new_tokens=4, do_sample=False, logits_processor=[nest])]
    ids += [engine.add_request(prompt, max_new_tokens=4, do_sample=False) for prompt in outer[1:]]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.prompt_id: o for o in engine.step() if o.finished})
    assert [finals[i].token_ids for i in ids] == expected_outer
    assert results == [expected_inner] * 4 and hfpaged.stats(model)["num_swapped_out"] > 0
    assert all_free(model)
