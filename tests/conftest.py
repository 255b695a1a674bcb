import os

import fast_interpreter
import interpreter_fp8
import pytest
import torch

# Triton decides between compiled and interpreted kernels when a kernel is defined (import time):
# without CUDA, the kernel tests need the interpreter, so set it before anything imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA = torch.cuda.is_available()

# Under pytest-xdist (`-n 2`, the README's test command) each worker takes one core: two workers with two torch
# threads each would oversubscribe a 2-core machine. Tests that start processes pass their own thread counts.
if os.environ.get("PYTEST_XDIST_WORKER") and not CUDA:
    torch.set_num_threads(1)


# Without CUDA the kernels run in Triton's interpreter: skip its repeated per-launch lookups (fast_interpreter.py)
fast_interpreter.install()
# ... and round to fp8 as a GPU does (interpreter_fp8.py)
interpreter_fp8.install()

# HFPAGED_TEST_COMPILE=0 / =1: every patch() that does not say otherwise runs with compile=False / compile=True
# instead of the default (None: compiled layers on CUDA), e.g. the GPU suite once more with eager layers
_TEST_COMPILE = os.environ.get("HFPAGED_TEST_COMPILE")
if _TEST_COMPILE is not None:
    import dataclasses
    import importlib

    from hfpaged.core.config import EngineConfig as _EngineConfig

    if _TEST_COMPILE not in ("0", "1"):
        raise ValueError(f"HFPAGED_TEST_COMPILE must be 0 or 1, got {_TEST_COMPILE!r}")
    _patch_module = importlib.import_module("hfpaged.patch")  # the module (hfpaged.patch is also the function)

    @dataclasses.dataclass
    class _CompileForTests(_EngineConfig):
        compile: bool | None = _TEST_COMPILE == "1"

    _patch_module.EngineConfig = _CompileForTests


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped without CUDA (the one place that decides it)."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """The in-memory byte-level BPE tokenizer (vocab 320) the text tests share."""
    from bpe_tokenizer import make_tokenizer

    return make_tokenizer()


@pytest.fixture(autouse=True)
def pool_is_free_after(request):
    """After every test that uses a patched ``model`` fixture, every block is free (or evictable)."""
    # taken at set-up, so the model is torn down after this check
    model = request.getfixturevalue("model") if "model" in request.fixturenames else None
    yield
    if getattr(model, "_hfpaged", None) is not None:
        import hfpaged

        stats = hfpaged.stats(model)
        assert stats["num_free_blocks"] == stats["num_blocks"], stats


@pytest.fixture(autouse=True, scope="module")
def heap_thawed_after_each_module():
    """A graph capture (on CUDA, or faked on the CPU as in test_graph_padding) freezes the process's heap
    (``EngineConfig.freeze_gc``) and the tests do not unpatch every model: thaw it after each module, so that no
    module runs on another's freeze and the process does not end frozen."""
    import gc

    yield
    gc.unfreeze()
