"""Overlapped steps (``async_scheduling``): a step's tokens are read back while the next step runs.

The next step reads them on the device; a request that stopped on one of them was planned into the
next step too, and that extra row is dropped. Outputs must equal the synchronous engine's and stock
``generate``'s token for token, and every block must come back.
"""

import pytest
import torch
from bpe_tokenizer import make_tokenizer
from models import ARCHS, make_model, random_prompts, reference_generate

import hfpaged

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]
LENGTHS = [1, 3, 9, 17, 33, 64, 5, 40]


def run_engine(model, prompts, **settings):
    """Every request through one Engine; returns (output ids per prompt, engine, outputs per step)."""
    engine = hfpaged.Engine(model)
    ids = [engine.add_request(p, **settings) for p in prompts]
    requests = [engine.core.scheduler.requests[i] for i in ids]
    per_step = []
    while engine.has_unfinished():
        per_step.append(engine.step())
    return [r.output_token_ids for r in requests], engine, per_step


def assert_pool_free(model):
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"], st


def eos_mid_way(model, prompts, device):
    free = reference_generate(model, prompts[:4], max_new_tokens=12, do_sample=False, eos_token_id=None)
    return next(ids[6] for ids in free if len(set(ids)) > 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_overlapped_greedy_equals_generate_with_eos_and_preemption(device, preemption_mode):
    model = make_model("llama").to(device)
    prompts = random_prompts(LENGTHS, seed=1)
    eos = eos_mid_way(model, prompts, device)
    expected = reference_generate(model, prompts, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    assert any(len(e) < 24 for e in expected), "eos never stopped a prompt mid-way"
    hfpaged.patch(
        model,
        num_blocks=26,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        preemption_mode=preemption_mode,
        swap_space=0.001,
    )
    got, engine, _ = run_engine(model, prompts, max_new_tokens=24, do_sample=False, eos_token_id=eos)
    assert got == expected
    assert engine.core.num_overlapped_steps > 0
    st = hfpaged.stats(model)
    assert st["num_preemptions"] > 0
    if preemption_mode == "swap":
        assert st["num_swapped_out"] > 0
    assert_pool_free(model)


@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_sampling_and_logprobs_equal_the_synchronous_engine(device):
    model = make_model("qwen3").to(device)
    prompts = random_prompts([4, 11, 30, 2, 19], seed=4)
    settings = dict(max_new_tokens=16, do_sample=True, seed=7, return_logprobs=True, top_logprobs=2)
    results = {}
    for overlap in (True, False):
        hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=3, async_scheduling=overlap)
        engine = hfpaged.Engine(model)
        requests = [engine.core.scheduler.requests[engine.add_request(p, **settings)] for p in prompts]
        while engine.has_unfinished():
            engine.step()
        assert (engine.core.num_overlapped_steps > 0) == overlap
        results[overlap] = [(r.output_token_ids, r.logprobs, r.top_logprobs) for r in requests]
        assert_pool_free(model)
        hfpaged.unpatch(model)
    for (ids_a, lp_a, top_a), (ids_b, lp_b, top_b) in zip(results[True], results[False]):
        assert ids_a == ids_b and len(lp_a) == len(ids_a) == len(top_a)
        assert torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b))
        assert [sorted(t) for t in top_a] == [sorted(t) for t in top_b]


def test_outputs_arrive_one_step_late_and_a_length_stop_is_not_planned_again():
    model = make_model("llama")
    hfpaged.patch(model, num_blocks=16, block_size=4)
    prompt = random_prompts([6], seed=2)[0]
    expected = reference_generate(model, [prompt], max_new_tokens=3, do_sample=False)[0]
    got, engine, per_step = run_engine(model, [prompt], max_new_tokens=3, do_sample=False)
    assert got == [expected]
    # step 1 prefills (nothing read yet); steps 2-3 decode and read the token before; step 4 only reads the
    # third token: the request reached max_new_tokens with it, so it was not planned into another forward
    assert [[o.new_token_ids for o in step] for step in per_step] == [
        [],
        [expected[:1]],
        [expected[1:2]],
        [expected[2:]],
    ]
    assert per_step[-1][0].finished and per_step[-1][0].finish_reason == "length"
    runner = engine.runner
    assert runner.num_eager_steps + runner.num_graph_steps == 3  # as many forwards as the synchronous engine
    assert_pool_free(model)


def test_abort_while_a_step_is_in_flight_frees_its_blocks_and_the_rest_stay_exact():
    model = make_model("llama")
    prompts = random_prompts([7, 12, 5], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    engine = hfpaged.Engine(model)
    ids = [engine.add_request(p, max_new_tokens=10, do_sample=False) for p in prompts]
    requests = [engine.core.scheduler.requests[i] for i in ids]
    for _ in range(3):
        engine.step()
    assert engine.core.in_flight is not None and requests[1].num_output_placeholders == 1
    engine.abort(ids[1])
    assert requests[1].is_finished and requests[1].num_output_placeholders == 0
    while engine.has_unfinished():
        engine.step()
    assert requests[0].output_token_ids == expected[0]
    assert requests[2].output_token_ids == expected[2]
    assert requests[1].output_token_ids == expected[1][: len(requests[1].output_token_ids)]
    assert_pool_free(model)

    # abort_all with a step in flight: nothing is left to run, and the next call is exact
    engine = hfpaged.Engine(model)
    for p in prompts:
        engine.add_request(p, max_new_tokens=10, do_sample=False)
    engine.step()
    engine.step()
    engine.abort_all()
    assert not engine.has_unfinished()
    assert_pool_free(model)
    assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=10, do_sample=False)] == expected


def test_an_id_reused_right_after_abort_gets_none_of_the_aborted_requests_tokens():
    # the aborted request's last step is still in flight when a new request takes its id: that step's token
    # (and logprob) belongs to the old request, never to the new one
    model = make_model("llama")
    prompts = random_prompts([7, 12, 9], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    engine = hfpaged.Engine(model)
    engine.add_request(prompts[0], request_id="other", max_new_tokens=8, do_sample=False)
    engine.add_request(prompts[1], request_id="x", max_new_tokens=8, do_sample=False)
    other = []
    for _ in range(3):
        other += [t for out in engine.step() if out.request_id == "other" for t in out.new_token_ids]
    assert engine.core.in_flight is not None
    engine.abort("x")
    engine.add_request(prompts[2], request_id="x", max_new_tokens=8, do_sample=False, return_logprobs=True)
    tokens, logprobs = {"other": other, "x": []}, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.request_id == "x":
                logprobs += out.new_logprobs
    assert tokens["x"] == expected[2] and len(logprobs) == len(expected[2])
    assert tokens["other"] == expected[0]
    assert_pool_free(model)


def test_overlapped_stop_strings_and_prefix_cache_equal_generate():
    tokenizer = make_tokenizer()
    model = make_model("llama", vocab_size=len(tokenizer), seed=3)
    system = tokenizer("the stop sign and the stars")["input_ids"]
    prompts = [system + tokenizer(t)["input_ids"] for t in ["question: what", "a quick brown", "café"]]
    free = reference_generate(model, prompts, max_new_tokens=12, do_sample=False)
    # a stop string that free-running decoding of the first prompt produces mid-way
    text = tokenizer.decode(free[0])
    stop = next(
        (text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].isprintable() and text[i : i + 2].strip()),
        None,
    )
    assert stop is not None, text
    expected = reference_generate(
        model, prompts, max_new_tokens=12, do_sample=False, stop_strings=[stop], tokenizer=tokenizer
    )
    assert len(expected[0]) < 12
    hfpaged.patch(
        model, num_blocks=40, block_size=4, max_num_seqs=1, tokenizer=tokenizer
    )  # one after another: later prompts hit the cache
    got, engine, _ = run_engine(model, prompts, max_new_tokens=12, do_sample=False, stop_strings=[stop])
    assert got == expected
    assert engine.core.num_overlapped_steps > 0
    assert hfpaged.stats(model)["prefix_cache_hits"] > 0
    assert_pool_free(model)


def test_logits_index_as_a_list_for_models_spread_over_devices():
    """Models on several devices take logits_to_keep as a list of ints (accelerate moves tensors to its
    first device); the same path on one device must give the same tokens, empty prefill-chunk steps included."""
    model = make_model("llama")
    prompts = random_prompts(LENGTHS, seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False)
    hfpaged.patch(model, num_blocks=40, block_size=4, max_num_seqs=3, max_num_batched_tokens=24)
    runner = hfpaged.Engine(model).runner
    runner.single_device = False  # as if the layers were spread over devices
    try:
        assert [r.token_ids for r in model.generate_many(prompts, max_new_tokens=8, do_sample=False)] == expected
    finally:
        runner.single_device = True
    assert_pool_free(model)


class _Event:
    """Stands in for the CUDA event of a step's copy to the host."""

    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def greedy_core_of_a_short_run(model):
    """Four prompts through a patched ``model`` (greedy, equal to stock generate); the engine core, model unpatched."""
    prompts = random_prompts(LENGTHS[:4], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=8, do_sample=False, eos_token_id=None)
    hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4)
    got, engine, _ = run_engine(model, prompts, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert got == expected
    hfpaged.unpatch(model)
    return engine.core


def test_ready_reads_count_steps_whose_tokens_landed_before_the_host_asked():
    """``is_ready`` reports whether reading a step would wait for the device (its copy's event); the engine counts
    the overlapped steps read without waiting, the measure of the device waiting on the host. On the CPU nothing
    is in flight, so every overlapped step counts."""
    from hfpaged.sampling.request_state import CachedRequestState
    from hfpaged.sampling.sampler import StepResult

    core = greedy_core_of_a_short_run(make_model("llama"))
    assert core.num_overlapped_steps > 0 and core.num_ready_reads == core.num_overlapped_steps

    state = CachedRequestState("r", None, [1, 2], 2)
    result = StepResult(torch.tensor([7]), [state])
    result._event = _Event(done=False)
    assert not result.is_ready()  # the copy has not landed: reading would wait
    assert result.result().token_ids == [7] and state.token_ids == [1, 2, 7]
    assert result.is_ready()  # read once: never waits again
    done = StepResult(torch.tensor([8]), [CachedRequestState("s", None, [1], 1)])
    done._event = _Event(done=True)
    assert done.is_ready()


@pytest.mark.gpu
def test_is_ready_follows_the_device_copy():
    """On CUDA: a step whose copy to the host is queued behind a long kernel is not ready until it lands, and the
    engine's ready count stays within its overlapped steps."""
    from hfpaged.sampling.request_state import CachedRequestState
    from hfpaged.sampling.sampler import StepResult

    tokens = torch.tensor([7], device="cuda")  # before the sleep: a copy from the host would wait for it
    torch.empty(1, pin_memory=True)  # the pinned buffer the step takes comes from the host allocator's cache
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the copy
    result = StepResult(tokens, [CachedRequestState("r", None, [1], 1)])
    assert not result.is_ready()
    assert result.result().token_ids == [7]
    assert result.is_ready()

    core = greedy_core_of_a_short_run(make_model("llama").cuda())
    assert core.num_overlapped_steps > 0 and 0 <= core.num_ready_reads <= core.num_overlapped_steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", [a for a in ("gpt2", "gptj") if a in ARCHS])  # GPT-J: transformers >= 5.2x
def test_an_eos_at_the_last_position_of_a_learned_position_table_is_not_planned_past_it(device, arch):
    """Stock stops a request whose token at the model's last position is an eos; the overlapped step planned one
    more forward at the first position past the table (an IndexError on the CPU, a device-side assert on CUDA, and
    every prompt of the step failed with it). A placeholder past the model's positions now waits to be read."""
    model = make_model(arch, seed=5, n_positions=32).to(device)
    prompt, short = random_prompts([32, 5], seed=32)
    eos = reference_generate(model, [prompt], max_new_tokens=1, do_sample=False)[0][0]
    expected = reference_generate(model, [prompt, short], max_new_tokens=2, do_sample=False, eos_token_id=eos)
    assert len(expected[0]) == 1  # ends at the eos, at position 32 of 32
    hfpaged.patch(model, num_blocks=64, block_size=4)
    got = model.generate_many([prompt, short], max_new_tokens=2, do_sample=False, eos_token_id=eos)
    assert [r.token_ids for r in got] == expected
    assert_pool_free(model)
