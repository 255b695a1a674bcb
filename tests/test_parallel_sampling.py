"""Parallel sampling (num_return_sequences=n, do_sample=True): the n sequences differ, each is exactly what a
single request with its sub-seed samples (so the shared, copied-on-write prompt blocks hold the right KV),
results are reproducible per seed and independent of batch companions, the prompt's blocks are shared,
and the pool is all free after every run."""

import pytest
import torch
from models import make_model, random_prompts

import hfpaged
from hfpaged.sampling.parallel_sampling import sample_seed
from hfpaged.testing import parallel_sampling_kv

SAMPLING = dict(do_sample=True, top_k=5, temperature=0.9, max_new_tokens=10, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=64, block_size=4)
    return m


def sequences(result):
    return [s.token_ids for s in result.sequences]


def single(model, prompt, seed, **settings):
    """What one request with this seed samples."""
    return model.generate_many([{"prompt": prompt, "seed": seed}], **{**SAMPLING, **settings})[0].token_ids


def test_each_sequence_is_the_sample_of_its_own_seed(model):
    prompts = random_prompts([5, 9, 16], seed=31)  # partly filled last blocks (5, 9) and a full one (16)
    results = model.generate_many(prompts, num_return_sequences=4, seed=100, **SAMPLING)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        got = sequences(result)
        assert len(got) == 4 and len({tuple(s) for s in got}) == 4
        assert got == [single(model, prompt, sample_seed(100 + i, j)) for j in range(4)]
        assert result.token_ids == got[0] and result.finish_reason == "length"
        assert [s.finish_reason for s in result.sequences] == ["length"] * 4


def test_reproducible_and_independent_of_batch_companions_and_of_pool_pressure():
    model = make_model("llama", seed=1)
    target = {"prompt": random_prompts([7], seed=32)[0], "seed": 77, "num_return_sequences": 4}
    hfpaged.patch(model, num_blocks=64, block_size=4)
    alone = sequences(model.generate_many([target], **SAMPLING)[0])
    assert sequences(model.generate_many([target], **SAMPLING)[0]) == alone
    companions = random_prompts([12, 3, 9], seed=33)
    # a pool that cannot hold everything at once: children are preempted and recomputed
    hfpaged.patch(model, num_blocks=16, block_size=4, max_num_seqs=6, max_num_batched_tokens=12)
    crowded = model.generate_many([companions[0], target, *companions[1:]], num_return_sequences=2, seed=5, **SAMPLING)
    assert sequences(crowded[1]) == alone
    assert [len(r.sequences) for r in crowded] == [2, 4, 2, 2]
    stats = hfpaged.stats(model)
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    # swap preemption too
    hfpaged.patch(
        model,
        num_blocks=16,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        preemption_mode="swap",
        swap_space=0.001,
    )
    swapped = model.generate_many([companions[0], target, *companions[1:]], num_return_sequences=2, seed=5, **SAMPLING)
    assert [sequences(r) for r in swapped] == [sequences(r) for r in crowded]
    assert hfpaged.stats(model)["num_swapped_out"] > 0
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]


def test_top_k_is_respected_by_every_sequence(model):
    prompts = random_prompts([3, 10], seed=34)
    results = model.generate_many(prompts, num_return_sequences=4, seed=9, **{**SAMPLING, "top_k": 3})
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            for ids in sequences(result):
                logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
                top3 = logits.topk(3, dim=-1).indices
                assert all(t in top3[i].tolist() for i, t in enumerate(ids))


def test_each_sequence_keeps_its_own_processor_state_and_stop_conditions(model):
    prompt = random_prompts([6], seed=35)[0]
    settings = dict(SAMPLING, no_repeat_ngram_size=2, top_k=0, temperature=1.5, max_new_tokens=16)
    result = model.generate_many([{"prompt": prompt, "seed": 3}], num_return_sequences=4, **settings)[0]
    for j, ids in enumerate(sequences(result)):
        assert ids == single(model, prompt, sample_seed(3, j), **settings)
        full = prompt + ids
        bigrams = list(zip(full, full[1:]))
        assert len(bigrams) == len(set(bigrams))
    # an eos that ends some sequences early, not others
    eos = sequences(result)[1][3]
    stopped = model.generate_many(
        [{"prompt": prompt, "seed": 3}], num_return_sequences=4, **{**settings, "eos_token_id": eos}
    )[0]
    for ids, s in zip(sequences(result), stopped.sequences):
        cut = ids.index(eos) + 1 if eos in ids else len(ids)
        assert s.token_ids == ids[:cut]
        assert s.finish_reason == ("stop" if eos in ids else "length")
    assert {s.finish_reason for s in stopped.sequences} == {"stop", "length"}


def test_logprobs_and_text_per_sequence(model):
    prompt = random_prompts([4], seed=36)[0]
    result = model.generate_many(
        [prompt], num_return_sequences=3, seed=4, return_logprobs=True, top_logprobs=2, **SAMPLING
    )[0]
    for j, s in enumerate(result.sequences):
        alone = model.generate_many(
            [{"prompt": prompt, "seed": sample_seed(4, j)}], return_logprobs=True, top_logprobs=2, **SAMPLING
        )[0]
        assert s.token_ids == alone.token_ids and s.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert len(s.top_logprobs) == len(s.token_ids) and s.text is None
    assert result.logprobs == result.sequences[0].logprobs


def test_the_prompt_blocks_are_shared(model):
    figures = parallel_sampling_kv(
        model, random_prompts([37, 20], seed=37), n=4, new_tokens=12, num_blocks=128, block_size=4
    )
    # 37 + 11 slots = 12 blocks per sequence: 4 independent copies of two prompts take 4 x (12 + 8) = 80;
    # shared, each prompt keeps its 9 (resp. 5) full blocks once and every sequence owns the rest
    assert figures["independent"]["peak_blocks"] == 80
    assert figures["parallel"]["peak_blocks"] == (9 + 4 * 3) + (5 + 4 * 3)
    assert figures["block_ratio"] < 0.5
    hfpaged.patch(model, num_blocks=64, block_size=4)


def test_stream_many_tells_which_sequence_each_event_extends(model):
    prompts = random_prompts([5, 8], seed=38)
    results = model.generate_many(prompts, num_return_sequences=3, seed=11, **SAMPLING)
    events = list(model.stream_many(prompts, num_return_sequences=3, seed=11, **SAMPLING))
    for index, result in enumerate(results):
        mine = [e for e in events if e.index == index]
        for j, sequence in enumerate(result.sequences):
            assert [t for e in mine if e.sequence_index == j for t in e.token_ids] == sequence.token_ids
        finished = [e for e in mine if e.finished]
        assert len(finished) == 3 and [e.result is not None for e in finished] == [False, False, True]
        assert sequences(finished[-1].result) == sequences(result)


def test_engine_outputs_and_abort_of_the_whole_prompt(model):
    engine = hfpaged.Engine(model)
    prompts = random_prompts([6, 9], seed=39)
    kept = engine.add_request(prompts[0], num_return_sequences=3, seed=1, **SAMPLING)
    dropped = engine.add_request(prompts[1], num_return_sequences=3, seed=2, **SAMPLING)
    gained: dict[tuple, list] = {}
    for _ in range(3):
        for out in engine.step():
            gained.setdefault((out.request_id, out.sequence_index), []).extend(out.new_token_ids)
    engine.abort(dropped)
    assert not any(r.request_id.startswith(dropped) for r in engine.core.scheduler.running)
    while engine.has_unfinished():
        for out in engine.step():
            gained.setdefault((out.request_id, out.sequence_index), []).extend(out.new_token_ids)
    expected = [single(model, prompts[0], sample_seed(1, j)) for j in range(3)]
    assert [gained[(kept if j == 0 else f"{kept}.{j}", j)] for j in range(3)] == expected
    assert not engine.prompts and not engine.core.scheduler.requests


def test_abort_after_the_first_sequence_finished_frees_the_others():
    # The prompt's first sequence (whose id is the prompt's) stops at eos while the second still runs: aborting the
    # prompt, or closing its stream, must end the second too (it used to keep running and hold its blocks, since
    # the prompt's id had left the scheduler's table with the first sequence).
    m = make_model("llama", seed=7)
    hfpaged.patch(m, async_scheduling=False)
    prompt = [69, 25, 69, 34, 36, 28, 13, 29, 59, 16, 93]
    settings = dict(max_new_tokens=30, do_sample=True, seed=1, num_return_sequences=2, eos_token_id=87)

    def idle():
        st = hfpaged.stats(m)
        return st["num_free_blocks"] == st["num_blocks"] and st["num_running_requests"] == 0

    engine = hfpaged.Engine(m)
    prompt_id = engine.add_request(prompt, **settings)
    first = None
    while first is None:
        first = next((out for out in engine.step() if out.finished), None)
    assert (first.sequence_index, first.finish_reason) == (0, "stop")  # the case under test
    engine.abort(prompt_id)
    assert idle() and not engine.core.scheduler.requests
    stream = m.stream_many([prompt], **settings)
    event = next(event for event in stream if event.finished)
    assert (event.sequence_index, event.finish_reason) == (0, "stop")
    stream.close()
    assert idle()


@pytest.mark.gpu
def test_cuda_parallel_samples_with_triton_and_graphs():
    model = make_model("llama").cuda()
    prompts = random_prompts([5, 9, 16, 3], seed=31)
    hfpaged.patch(model, num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    results = model.generate_many(prompts, num_return_sequences=4, seed=100, **SAMPLING)
    assert model._hfpaged.engine.runner.num_graph_steps > 0 and hfpaged.stats(model)["num_preemptions"] > 0
    hfpaged.patch(model, num_blocks=64, block_size=4)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert sequences(result) == [single(model, prompt, sample_seed(100 + i, j)) for j in range(4)]
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_return_sequences=2, do_sample=False), "Greedy methods .* .num_return_sequences. different than 1"),
        (dict(num_return_sequences=20, do_sample=True), "max_num_seqs is 8"),
    ],
)
def test_settings_that_cannot_run_raise_clearly(kwargs, message):
    m = make_model("llama")
    hfpaged.patch(m, num_blocks=16, block_size=4, max_num_seqs=8)
    with pytest.raises(ValueError, match=message):
        m.generate_many([[4, 5]], max_new_tokens=3, **kwargs)
    with pytest.raises(ValueError, match="streams one sequence"):
        m.generate_many([[4, 5]], max_new_tokens=3, num_return_sequences=2, do_sample=True, streamer=object())


def test_a_prompt_id_stays_taken_while_any_of_its_sequences_runs():
    # once a prompt's first sequence (whose id is the prompt's) had finished, its id counted as free while the
    # second still ran: another handle could take it (chosen, or generated as "req-N"), the forked "x.1" names
    # clashed, outputs went to the wrong handle and an abort left a request running outside the table
    m = make_model("llama", seed=7)
    hfpaged.patch(m, async_scheduling=False)
    prompt = [69, 25, 69, 34, 36, 28, 13, 29, 59, 16, 93]
    settings = dict(max_new_tokens=30, do_sample=True, seed=1, num_return_sequences=2, eos_token_id=87)
    a, b = hfpaged.Engine(m), hfpaged.Engine(m)
    number = int(b.add_request([5, 6, 7], max_new_tokens=1).split("-")[1])
    while b.has_unfinished():
        b.step()
    chosen = f"req-{number + 2}"  # what b's second generated id would be
    a.add_request(prompt, request_id=chosen, **settings)
    while not any(out.finished for out in a.step()):
        pass
    assert list(a.core.scheduler.requests) == [f"{chosen}.1"]  # the case under test: the first finished
    with pytest.raises(ValueError, match=f"request_id '{chosen}' is already in use"):
        b.add_request(prompt, request_id=chosen, **settings)
    generated = [b.add_request([5, 6, 7], max_new_tokens=20) for _ in range(2)]
    assert chosen not in generated
    finished_a, finished_b = [], []
    while a.has_unfinished() or b.has_unfinished():
        finished_a += [out.request_id for out in a.step() if out.finished]
        finished_b += [out.request_id for out in b.step() if out.finished]
    assert finished_a == [f"{chosen}.1"] and sorted(finished_b) == sorted(generated)
    st = hfpaged.stats(m)
    assert st["num_free_blocks"] == st["num_blocks"] and st["num_running_requests"] == 0
