"""``EngineConfig.freeze_gc``: after each CUDA graph capture the runner collects and ``gc.freeze()``s the heap the
warm-up left behind, so that Python's full collections skip it; dropping what it captured (``sleep``, weights in
new storage, ``unpatch``) thaws it. Captures run on CUDA only (``test_gpu_reliability.py`` has the whole path,
deletion of a frozen model included); here the runner's freeze is called where a capture would call it."""

import gc
import subprocess
import sys
import weakref

import pytest
import torch
from models import make_model, random_prompts, reference_generate

import hfpaged
from hfpaged.engine import engine_of
from hfpaged.model.gc_heap import HeapFreeze


@pytest.fixture(autouse=True)
def thawed():
    yield
    gc.unfreeze()  # no test leaves the process's heap frozen


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def greedy(model, prompts):
    return [r.token_ids for r in model.generate_many(prompts, max_new_tokens=6, do_sample=False)]


def test_freeze_collects_garbage_cycles_first_then_freezes_what_is_alive():
    cycle = Node()
    dead = weakref.ref(cycle)
    del cycle
    alive = Node()
    heap = HeapFreeze(enabled=True)
    heap.freeze()
    assert dead() is None  # collected, not frozen for good
    assert heap.frozen and gc.get_freeze_count() > 0
    assert not any(o is alive for o in gc.get_objects())  # out of every generation a collection walks
    heap.thaw()
    assert not heap.frozen and gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())
    heap.thaw()  # a second thaw does nothing
    assert gc.get_freeze_count() == 0


def test_a_disabled_freeze_leaves_the_collector_alone():
    heap = HeapFreeze(enabled=False)
    heap.freeze()
    assert not heap.frozen and gc.get_freeze_count() == 0


def test_sleep_new_weights_and_unpatch_thaw_the_engines_freeze():
    model = make_model("llama", seed=31)
    prompts = random_prompts([5, 9, 14], seed=2)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4)
    runner = engine_of(model).runner
    assert runner.heap.enabled  # the default

    runner.heap.freeze()  # where a capture freezes (CUDA)
    assert greedy(model, prompts) == expected  # the same tokens with the heap frozen
    hfpaged.sleep(model)
    assert not runner.heap.frozen and gc.get_freeze_count() == 0

    runner.heap.freeze()
    with torch.no_grad():  # same values in new storage: the next call drops the graphs, and the freeze with them
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
    assert greedy(model, prompts) == expected
    assert not runner.heap.frozen and gc.get_freeze_count() == 0

    runner.heap.freeze()
    hfpaged.unpatch(model)
    assert gc.get_freeze_count() == 0


def test_freeze_gc_false_opts_out_and_a_bad_value_is_refused_leaving_the_model_as_it_was():
    model = make_model("llama", seed=32)
    prompts = random_prompts([7, 3], seed=4)
    expected = reference_generate(model, prompts, max_new_tokens=6, do_sample=False)
    hfpaged.patch(model, num_blocks=32, block_size=4, freeze_gc=False)
    engine_of(model).runner.heap.freeze()
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="freeze_gc must be True or False, got 'yes'"):
        hfpaged.patch(model, num_blocks=32, block_size=4, freeze_gc="yes")
    assert model._hfpaged.config.freeze_gc is False  # still patched as before, and usable
    assert greedy(model, prompts) == expected


def test_a_frozen_heap_is_thawed_at_exit():
    """The first freeze registers ``gc.unfreeze`` with atexit: the interpreter's last collection reaches every object
    again (a check registered before the freeze runs after the thaw)."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "from hfpaged.model.gc_heap import HeapFreeze\n"
        "HeapFreeze(True).freeze(); HeapFreeze(True).freeze()\n"
        "print('frozen:', gc.get_freeze_count() > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split("\n")[:2] == ["frozen: True", "frozen at exit: 0"]
