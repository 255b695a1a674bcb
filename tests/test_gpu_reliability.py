"""On CUDA, with CUDA graphs and overlapped steps: concurrent callers, weights changed after the graphs were
captured, and a real out-of-memory error inside a step (run with ``pytest -m gpu`` on a GPU)."""

import threading

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged

pytestmark = pytest.mark.gpu

LENGTHS = [3, 17, 9, 33, 5, 24, 12, 40]
NEW = 12


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=NEW, do_sample=False)]


def patched(arch="llama", seed=3, **options):
    model = make_model(arch, seed=seed).cuda()
    hfpaged.patch(
        model, **{"num_blocks": 64, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 48, **options}
    )
    return model


def test_cuda_threads_and_stock_calls_with_graphs_and_overlap_are_exact():
    model = patched()
    calls = [random_prompts(LENGTHS, seed=s) for s in range(3)]
    expected = [reference_generate(model, p, max_new_tokens=NEW, do_sample=False) for p in calls]
    batch = torch.tensor([[0] * 7 + calls[0][1][:5], calls[0][3][:12]], device="cuda")
    mask = torch.tensor([[0] * 7 + [1] * 5, [1] * 12], device="cuda")
    stock = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got, stock_runs, errors = [None] * len(calls), [], []

    def paged(i):
        try:
            got[i] = greedy(model, calls[i])
        except BaseException as exc:
            errors.append(exc)

    def stock_caller():
        try:
            for _ in range(4):
                stock_runs.append(model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=paged, args=(i,)) for i in range(len(calls))]
    threads.append(threading.Thread(target=stock_caller))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert got == expected
    assert all(torch.equal(s, stock) for s in stock_runs) and len(stock_runs) == 4
    core = model._hfpaged.engine
    assert core.runner.num_graph_steps > 0 and core.num_overlapped_steps > 0
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"]


def test_cuda_an_optimizer_step_after_capture_is_used_by_the_graphs():
    model = patched()
    prompts = random_prompts(LENGTHS, seed=9)
    assert greedy(model, prompts) == reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    graphs = model._hfpaged.engine.runner.graphs
    assert graphs is not None
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        ids = torch.tensor([prompts[3]], device="cuda")
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert greedy(model, prompts) == reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    assert model._hfpaged.engine.runner.graphs is graphs  # same storage: the graphs read the new values


def test_cuda_weights_in_new_storage_recapture_the_graphs():
    model = patched()
    prompts = random_prompts(LENGTHS, seed=10)
    greedy(model, prompts)
    graphs = model._hfpaged.engine.runner.graphs
    other = make_model("llama", seed=77).cuda()
    model.load_state_dict(other.state_dict(), assign=True)  # new tensors: the old graphs point at freed memory
    assert greedy(model, prompts) == reference_generate(other, prompts, max_new_tokens=NEW, do_sample=False)
    assert model._hfpaged.engine.runner.graphs is not graphs


def test_cuda_out_of_memory_inside_a_step_is_reported_and_recovered_from():
    model = patched("qwen3", max_num_batched_tokens=4096, num_blocks=1024)
    prompts = random_prompts([400] * 8, seed=11)
    expected = reference_generate(model, prompts[:2], max_new_tokens=4, do_sample=False)
    filler = []
    torch.cuda.empty_cache()
    for size in (1 << 30, 1 << 26, 1 << 22, 1 << 18):  # take (almost) every free byte
        try:
            while True:
                filler.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            pass
    try:
        with pytest.raises(torch.OutOfMemoryError, match="Lower max_num_batched_tokens"):
            model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    finally:
        filler.clear()
        torch.cuda.empty_cache()
    st = hfpaged.stats(model)
    assert st["num_free_blocks"] == st["num_blocks"] and not model._hfpaged.engine.scheduler.requests
    assert [r.token_ids for r in model.generate_many(prompts[:2], max_new_tokens=4, do_sample=False)] == expected


def test_cuda_the_heap_is_frozen_after_the_captures_thawed_by_sleep_and_a_frozen_model_is_freed_on_del():
    import gc
    import weakref

    model = patched()  # compiled layers, decode and mixed graphs
    prompts = random_prompts(LENGTHS, seed=7)
    expected = reference_generate(model, prompts, max_new_tokens=NEW, do_sample=False)
    try:
        assert greedy(model, prompts) == expected
        runner = model._hfpaged.engine.runner
        assert runner.graphs is not None and runner.mixed_graphs is not None
        assert runner.heap.frozen and gc.get_freeze_count() > 0
        hfpaged.sleep(model)
        assert not runner.heap.frozen and gc.get_freeze_count() == 0
        assert greedy(model, prompts) == expected  # woken, captured and frozen again
        assert runner.heap.frozen and gc.get_freeze_count() > 0
        # deleted without unpatch while frozen: reference counting alone must free the engine and the pool (a
        # reference cycle among them would be kept for good by the freeze)
        engine = weakref.ref(model._hfpaged.engine)
        caches = weakref.ref(model._hfpaged.kv_caches[0][0])
        del runner
        gc.disable()
        del model
        assert engine() is None and caches() is None
    finally:
        gc.enable()
        gc.unfreeze()
