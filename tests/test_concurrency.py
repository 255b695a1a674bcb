"""Several callers at once: threads and asyncio tasks on one model share its engine and each get exactly
their own results; stock calls in other threads are unaffected; two models in two threads are independent."""

import asyncio
import threading

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

LENGTHS = [3, 17, 9, 33, 5, 24, 12, 40]
NEW = 12


def run_threads(*targets):
    """Run the callables in threads (started together); re-raise the first failure."""
    errors = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn):
        def go():
            barrier.wait()
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return go

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    if errors:
        raise errors[0]


@pytest.fixture
def model():
    m = make_model("llama", seed=11)
    # small pool and budget: the callers' requests preempt each other and share steps
    hfpaged.patch(m, num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    return m


def test_threads_calling_generate_many_each_get_their_own_exact_results(model):
    calls = [random_prompts(LENGTHS, seed=s) for s in range(4)]
    expected = [reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False) for prompts in calls]
    got = [None] * len(calls)

    def caller(i):
        def run():
            got[i] = [r.token_ids for r in model.generate_many(calls[i], max_new_tokens=NEW, do_sample=False)]

        return run

    run_threads(*(caller(i) for i in range(len(calls))))
    assert got == expected
    st = hfpaged.stats(model)
    assert st["num_preemptions"] > 0
    core = model._hfpaged.engine
    # the callers shared steps: fewer steps than running them one after another would take
    assert core.timings["steps"] > 0 and not core.owners and not core.scheduler.requests
    # and the model is still exact for a single caller afterwards (no corrupt prefix blocks)
    assert [r.token_ids for r in model.generate_many(calls[0], max_new_tokens=NEW, do_sample=False)] == expected[0]


def test_seeded_sampling_and_streams_across_threads_equal_single_caller_runs(model):
    prompts = random_prompts(LENGTHS, seed=7)
    sampled = dict(max_new_tokens=NEW, do_sample=True, top_k=8, seed=5)
    alone = [r.token_ids for r in model.generate_many(prompts, **sampled)]
    stream_alone = {}
    for event in model.stream_many(prompts[:4], max_new_tokens=NEW, do_sample=False):
        stream_alone.setdefault(event.index, []).extend(event.token_ids)
    got_sampled, got_stream = [], {}

    def sample():
        got_sampled.extend(r.token_ids for r in model.generate_many(prompts, **sampled))

    def stream():
        for event in model.stream_many(prompts[:4], max_new_tokens=NEW, do_sample=False):
            got_stream.setdefault(event.index, []).extend(event.token_ids)

    run_threads(sample, stream, sample)
    assert got_sampled == alone + alone
    assert got_stream == stream_alone


def test_asyncio_streams_on_one_model_each_get_their_own_tokens(model):
    calls = [random_prompts(LENGTHS[:5], seed=s) for s in (20, 21, 22)]
    expected = [reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False) for prompts in calls]

    async def collect(prompts):
        tokens = {}
        async for event in model.astream_many(prompts, max_new_tokens=NEW, do_sample=False):
            tokens.setdefault(event.index, []).extend(event.token_ids)
        return [tokens[i] for i in range(len(prompts))]

    async def main():
        return await asyncio.gather(*(collect(p) for p in calls))

    assert asyncio.run(main()) == expected


def test_stock_generate_and_forward_in_another_thread_while_steps_run(model):
    prompts = random_prompts(LENGTHS, seed=30)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    batch = torch.tensor([[0] * 7 + prompts[1][:5], prompts[3][:12]])  # left padding: needs the real mask
    mask = torch.tensor([[0] * 7 + [1] * 5, [1] * 12])
    with torch.no_grad():
        logits = model(batch, attention_mask=mask).logits
    stock = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    paged, stock_runs = [], []

    def paged_caller():
        for _ in range(3):
            paged.append([r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)])

    def stock_caller():
        for _ in range(6):
            with torch.no_grad():
                assert torch.equal(model(batch, attention_mask=mask).logits, logits)
            stock_runs.append(model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False))

    run_threads(paged_caller, stock_caller)
    assert paged == [expected] * 3
    assert all(torch.equal(s, stock) for s in stock_runs) and len(stock_runs) == 6


def test_two_models_in_two_threads_are_independent():
    first, second = make_model("llama", seed=1), make_model("qwen3", seed=2)
    prompts = random_prompts(LENGTHS, seed=40)
    expected = {id(m): reference_generate(m, prompts, max_new_tokens=NEW, do_sample=False) for m in (first, second)}
    for m in (first, second):
        hfpaged.patch(m, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    got = {}

    def caller(m):
        def run():
            for _ in range(2):
                got.setdefault(id(m), []).append(
                    [r.token_ids for r in m.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]
                )

        return run

    run_threads(caller(first), caller(second))
    for m in (first, second):
        assert got[id(m)] == [expected[id(m)]] * 2
        st = hfpaged.stats(m)
        assert st["num_free_blocks"] == st["num_blocks"]


def test_engine_handles_share_batches_and_get_only_their_outputs(model):
    prompts = random_prompts(LENGTHS[:4], seed=50)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    first, second = hfpaged.Engine(model), hfpaged.Engine(model)
    ids = {first.add_request(p, max_new_tokens=NEW, do_sample=False): (first, i) for i, p in enumerate(prompts[:2])}
    ids.update(
        {second.add_request(p, max_new_tokens=NEW, do_sample=False): (second, i + 2) for i, p in enumerate(prompts[2:])}
    )
    gained = {rid: [] for rid in ids}
    while first.has_unfinished() or second.has_unfinished():
        for handle in (first, second):
            for out in handle.step():
                assert ids[out.request_id][0] is handle  # only its own requests' outputs
                gained[out.request_id].extend(out.new_token_ids)
    assert [gained[rid] for rid in ids] == expected


def test_a_suspended_stream_does_not_block_a_call_that_fits_alone(model):
    """A stream left suspended keeps its requests in the engine; the next call runs them along with its own
    (or preempts them) and completes."""
    prompts = random_prompts([30, 31, 29, 33], seed=60)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    stream = model.stream_many(prompts, max_new_tokens=NEW, do_sample=False)
    first = next(stream)  # suspended with its requests holding most of the pool
    assert first.token_ids
    results = model.generate_many(prompts[:1], max_new_tokens=NEW, do_sample=False)
    assert results[0].token_ids == expected[0]
    rest = {}
    for event in stream:  # resumed: its tokens kept arriving meanwhile, none lost
        rest.setdefault(event.index, []).extend(event.token_ids)
    tokens = {i: rest.get(i, []) for i in range(len(prompts))}
    tokens[first.index] = first.token_ids + tokens[first.index]
    assert [tokens[i] for i in range(len(prompts))] == expected


def test_autocast_around_a_call_or_patch_is_ignored_and_said_so():
    """The engine's steps are shared by every caller: one caller's ``torch.autocast`` decided the numbers of
    another's requests (a probe: a float32 caller beside one under bf16 autocast got other tokens in every call),
    and autocast around ``patch`` made a bfloat16 pool for a float32 GPT-2. Both now run in the model's dtype."""
    model = make_model("gpt2", seed=5)
    prompts = random_prompts([5, 9, 13, 20], seed=3)
    expected = reference_generate(model, prompts, max_new_tokens=10, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hfpaged.patch(model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    assert hfpaged.stats(model)["kv_cache_dtype"] == "float32"
    results = {}

    def call(name, autocast):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                for i in range(3):
                    got = model.generate_many(prompts, max_new_tokens=10, do_sample=False)
                    results[name, i] = [r.token_ids for r in got]

        return run

    with pytest.warns(UserWarning, match="hfpaged ignores torch.autocast"):
        run_threads(call("plain", False), call("autocast", True))
    assert all(tokens == expected for tokens in results.values()) and len(results) == 6
    assert hfpaged.stats(model)["num_free_blocks"] == hfpaged.stats(model)["num_blocks"]
