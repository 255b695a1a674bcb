"""The runner's Triton kernel warm-up in a background thread (hfpaged/model/kernel_warmup.py): it runs beside the
first layer compile, is joined before the first CUDA graph capture or eager forward, and its errors reach the
caller as if it had run in the caller's thread. (On CUDA the engine path itself is covered by the GPU suites.)"""

import threading

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.model import cuda_graphs, kernel_warmup
from hfpaged.model.cuda_graphs import StepGraphs
from hfpaged.model.kernel_warmup import BackgroundWarmup

CPU = torch.device("cpu")


def test_the_body_runs_in_its_own_thread_until_finish_joins_it():
    release, seen = threading.Event(), []

    def body():
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))
        release.wait(10)

    warmup = BackgroundWarmup(body, CPU, overlap=True)
    warmup.start()
    assert warmup.started and warmup.running  # the caller goes on while the body runs
    warmup.start()  # once only
    release.set()
    warmup.finish()
    assert seen == [("hfpaged-kernel-warmup", True)]
    assert not warmup.running and warmup.seconds > 0
    warmup.finish()  # idempotent


def test_an_error_of_the_body_is_raised_once_by_finish():
    boom = RuntimeError("warm-up failed")

    def body():
        raise boom

    warmup = BackgroundWarmup(body, CPU, overlap=True)
    warmup.start()
    warmup.wait()  # waits without raising
    with pytest.raises(RuntimeError, match="warm-up failed") as caught:
        warmup.finish()
    assert caught.value is boom and warmup.raised is boom
    warmup.finish()  # raised once


def test_without_overlap_start_runs_the_body_in_the_callers_thread():
    names = []
    warmup = BackgroundWarmup(lambda: names.append(threading.current_thread().name), CPU, overlap=False)
    warmup.start()
    assert names == [threading.current_thread().name] and not warmup.running
    failing = BackgroundWarmup(lambda: 1 / 0, CPU, overlap=False)
    with pytest.raises(ZeroDivisionError):
        failing.start()


def test_the_overlap_switch_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HFPAGED_WARMUP_OVERLAP", "0")
    assert kernel_warmup._overlap_from_env() is False
    monkeypatch.setenv("HFPAGED_WARMUP_OVERLAP", "1")
    assert kernel_warmup._overlap_from_env() is True
    monkeypatch.setenv("HFPAGED_WARMUP_OVERLAP", "yes")
    with pytest.raises(ValueError, match="HFPAGED_WARMUP_OVERLAP must be 0 or 1"):
        kernel_warmup._overlap_from_env()


class _RecordingGraphs(StepGraphs):
    """StepGraphs whose warm-ups and captures only record their order (no CUDA)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _warm_up(self, forward, bucket, stream, calls, hint=None):
        self.events.append(("warm", bucket, calls))
        return torch.zeros(bucket, 4)

    def _capture_one(self, forward, bucket, pool, stream, shared, hint=None):
        self.events.append(("capture", bucket, hint))
        return None, None, None


@pytest.mark.parametrize("mixed", [False, True])
def test_capture_joins_the_warmup_after_the_first_compile_and_before_the_first_capture(mixed, monkeypatch):
    for name, value in (("graph_pool_handle", lambda: None), ("Stream", lambda device: None),
                        ("synchronize", lambda device=None: None)):  # fmt: skip
        monkeypatch.setattr(cuda_graphs.torch.cuda, name, value)
    options = dict(mixed=True, max_num_tokens=64, short_prompt_hint=32) if mixed else {}
    graphs = _RecordingGraphs(CPU, 8, 16, 16, **options)
    graphs.capture(lambda step: None, before_capture=lambda: graphs.events.append(("join",)))
    largest = graphs.buckets[-1]
    assert graphs.events[:3] == [("warm", largest, 2), ("join",), ("capture", largest, None)]
    assert graphs.events.count(("join",)) == 1
    assert {e[1] for e in graphs.events if e[0] == "capture"} == set(graphs.buckets)


def _failing_warmup(runner, error):
    def body():
        raise error

    runner.kernel_warmup = BackgroundWarmup(body, runner.device, overlap=True)
    runner.warm_kernels = True  # as on CUDA


def test_a_failed_warmup_fails_the_first_call_and_leaves_the_engine_usable():
    model = make_model("llama")
    prompts = random_prompts([5, 9, 3], seed=4)
    expected = reference_generate(model, prompts, max_new_tokens=4, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    runner = model._hfpaged.engine.runner
    _failing_warmup(runner, RuntimeError("kernel warm-up failed: out of memory"))
    with pytest.raises(RuntimeError, match="kernel warm-up failed"):
        model.generate_many(prompts, max_new_tokens=4, do_sample=False)
    stats = hfpaged.stats(model)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=4, do_sample=False)]
    assert got == expected  # the warm-up ran once: the next call does not start it again
    hfpaged.unpatch(model)


def test_the_warmup_is_joined_before_the_first_eager_forward():
    model = make_model("llama")
    prompts = random_prompts([6, 2], seed=5)
    expected = reference_generate(model, prompts, max_new_tokens=3, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    runner = model._hfpaged.engine.runner
    release, order = threading.Event(), []

    def body():
        release.wait(10)
        order.append("warm-up done")

    runner.kernel_warmup = BackgroundWarmup(body, runner.device, overlap=True)
    runner.warm_kernels = True
    forward = runner.forward

    def recording_forward(*args, **kwargs):
        order.append("forward")
        return forward(*args, **kwargs)

    runner.forward = recording_forward
    threading.Timer(0.2, release.set).start()
    got = [r.token_ids for r in model.generate_many(prompts, max_new_tokens=3, do_sample=False)]
    assert got == expected
    assert order[0] == "warm-up done" and order.count("warm-up done") == 1 and "forward" in order
    hfpaged.unpatch(model)
