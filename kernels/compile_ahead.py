"""The kernel warm-up's Triton compiles in worker processes, ahead of its own launches.

The warm-up (warmup.py) compiles a few dozen kernel variants. In threads their Python front ends take turns on the
GIL; a compile needs no GPU though, only the kernel's source, its specialisation (signature, constants, alignment
attributes), the options and the target, and it lands in Triton's on-disk cache under a key of exactly those. So
``compile_ahead`` runs the warm-up's launches once with Triton's ``jit_cache_hook`` set for this thread only: each
variant this process has not compiled is recorded (Triton's serialised specialisation, as its ``preload`` reads it)
and skipped (no compile, no launch). The ones not yet in the on-disk cache are compiled by up to
``HFPAGED_WARMUP_PROCESSES`` (default 16, at most one per core) worker processes (``python -c``: no import of the
caller's ``__main__``, no CUDA; each loads only this package, torch and Triton); then the warm-up's launches run as
before and find every compile in the cache. Anything that fails here leaves its variant to that in-process pass, which raises real
errors as it always did; ``HFPAGED_WARMUP_PROCESSES=0`` turns this off.

``start_compile_ahead`` returns while the workers run (the runner's first layer compile, dynamo's tracing and
Inductor's, needs none of these kernels and runs beside them): until ``Ahead.join()``, a Triton-global
``jit_cache_hook`` makes any in-process compile of this package's kernels, in any thread, join the workers first, so
that compile finds their entry instead of doing the work twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time

from ._checks import interpreting
from .compile_workers import Workers, source

logger = logging.getLogger("hfpaged")
PACKAGE = __name__.rpartition(".")[0]  # hfpaged.kernels
MIN_JOBS = 4  # fewer compiles than this stay in the warm-up's own threads (a worker's start-up costs ~1-3 s)
_RECORDING = threading.Lock()  # one recording at a time: the hook is Triton-global
_LOCAL = threading.local()


def recording() -> bool:
    """Whether this thread is recording compiles (its launches must stay in this thread: see run_all)."""
    return getattr(_LOCAL, "recording", False)


def _processes_from_env() -> int:
    value = os.environ.get("HFPAGED_WARMUP_PROCESSES", "16")
    if not value.isdigit():
        raise ValueError(f"HFPAGED_WARMUP_PROCESSES must be a non-negative integer, got {value!r}")
    return int(value)


WARMUP_PROCESSES = _processes_from_env()


def record_compiles(launch_all) -> list[dict]:
    """Run ``launch_all()`` with this thread's Triton compiles of this package's kernels recorded and skipped (the
    launches that would compile do nothing); other threads, and kernels already compiled here, run as usual.
    Returns the recorded compiles: {"module", "name", "data"} (``data``: Triton's serialised specialisation)."""
    jobs: list[dict] = []
    me = threading.get_ident()

    def hook(fn, compile, **kwargs):
        data = compile.get("specialization_data")
        if threading.get_ident() == me and fn.module.startswith(PACKAGE + ".") and data is not None:
            jobs.append({"module": fn.module, "name": fn.name, "data": data})
            return True  # skip: no compile, no launch
        return None  # Triton's own hook set before this one is called after (_set_hook)

    with _RECORDING:
        release = _set_hook(hook)
        _LOCAL.recording = True
        try:
            launch_all()
        finally:
            _LOCAL.recording = False
            release()
    unique = {}
    for job in jobs:
        unique.setdefault((job["module"], job["name"], job["data"]), job)
    return list(unique.values())


def _is_cached(job: dict, target) -> bool:
    """Whether Triton's on-disk cache holds the compile (the lookup ``triton.compile`` starts with)."""
    from triton import knobs
    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key, get_cache_manager, make_backend

    if getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        return False  # the key then has a part this lookup does not compute
    backend = make_backend(target)
    src, options = source(job, backend)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    name = f"{src.name[:150]}.json"
    group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
    return group.get(name) is not None


def compile_ahead(launch_all, device, processes: int | None = None) -> dict:
    """Compile the Triton variants ``launch_all()`` would compile in worker processes and wait for them (see the
    module docstring); the caller then runs ``launch_all()`` itself. Returns counts: recorded, missing from the disk
    cache, worker processes, still missing after them (those compile in the caller's pass); the workers' longest
    compile and their compiles' total (seconds)."""
    return start_compile_ahead(launch_all, device, processes).join()


def start_compile_ahead(launch_all, device, processes: int | None = None, pin_cache_dir: bool = False) -> Ahead:
    """``compile_ahead`` without the wait: the workers run on until ``join()`` (or an in-process compile of one of
    this package's kernels, which joins them first). ``pin_cache_dir``: the workers run beside torch.compile; where
    ``TRITON_CACHE_DIR`` is unset, set it now to the directory Inductor would set it to at its first kernel built in
    this process (when unset), which would come after the workers' start: the workers' entries and this process's
    later lookups would then be in two directories, and every one of its compiles a second one."""
    from triton import knobs

    processes = WARMUP_PROCESSES if processes is None else processes
    stats = {"recorded": 0, "missing": 0, "workers": 0, "still_missing": 0, "slowest_compile_s": 0.0, "compile_s": 0.0}
    if device.type != "cuda" or processes < 1 or interpreting() or knobs.compilation.always_compile:
        return Ahead(stats)
    if getattr(sys, "frozen", False):  # a frozen application: sys.executable is the application, not Python
        return Ahead(stats)
    if pin_cache_dir and os.getenv("TRITON_CACHE_DIR") is None:
        with contextlib.suppress(ImportError):  # as Inductor's CachingAutotuner sets it (whichever sets it first wins)
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

            os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device.index or 0)
    from triton.runtime import driver

    jobs = record_compiles(launch_all)
    with _on(device):
        target = driver.active.get_current_target()  # the runner's device's (the current device may be another)
    try:
        missing = [job for job in jobs if not _is_cached(job, target)]
    except Exception:  # an internal of another Triton version: leave every compile to the caller's pass
        logger.debug("hfpaged: compile_ahead could not read Triton's cache", exc_info=True)
        return Ahead({**stats, "recorded": len(jobs)})
    stats.update(recorded=len(jobs), missing=len(missing))
    if len(missing) < MIN_JOBS:
        return Ahead(stats)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(processes, cores, len(missing))  # the cores this process may run on
    stats["workers"] = workers
    try:
        started = Workers(sorted(missing, key=_cost, reverse=True), target, workers)
    except Exception:  # the workers could not start (or their directory failed): the caller's pass compiles all
        logger.debug("hfpaged: compile_ahead's workers failed", exc_info=True)
        return Ahead({**stats, "still_missing": len(missing)})
    return Ahead(stats, started, missing, target)


class Ahead:
    """The warm-up's compiles in worker processes: ``stats`` (``compile_ahead``'s counts), complete once ``join()``
    returned; ``running`` while the workers may still run. While they run, Triton's ``jit_cache_hook`` (every thread)
    joins them before any compile of this package's kernels in this process; ``join()`` takes it off again."""

    def __init__(self, stats: dict, workers: Workers | None = None, missing=(), target=None):
        self.stats = stats
        self.started = time.perf_counter()
        self._workers = workers
        self._missing = list(missing)
        self._target = target
        self._lock = threading.Lock()
        self._release = _hold_compiles(self.join) if workers is not None else None

    @property
    def running(self) -> bool:
        return self._workers is not None

    def join(self) -> dict:
        """Wait for the workers (once; any thread), take the hook off, and complete ``stats``."""
        with self._lock:
            workers = self._workers
            if workers is None:
                return self.stats
            start = time.perf_counter()
            self.stats["joined_after_s"] = round(start - self.started, 2)  # how long they ran beside the caller
            self.stats["still_missing"] = len(self._missing)  # until the workers are known to have compiled them
            try:
                seconds = workers.wait()
            except Exception:  # their directory failed: the caller's pass compiles what is missing
                logger.debug("hfpaged: compile_ahead's workers failed", exc_info=True)
                seconds = []
            finally:  # an interrupt too: the workers were killed, nothing is held any more
                self._workers = None
                self._release()
            try:
                self.stats["still_missing"] = sum(not _is_cached(job, self._target) for job in self._missing)
            except Exception:  # as in start_compile_ahead: the caller's pass compiles whatever is missing
                logger.debug("hfpaged: compile_ahead could not read Triton's cache", exc_info=True)
            self.stats["slowest_compile_s"] = round(max(seconds, default=0.0), 2)
            self.stats["compile_s"] = round(sum(seconds), 2)  # over all workers
            self.stats["join_wait_s"] = round(time.perf_counter() - start, 2)  # how long the joining thread waited
            return self.stats


def _hold_compiles(join):
    """Set Triton's ``jit_cache_hook`` so that a compile of this package's kernels, in any thread, calls ``join()``
    first and then goes on (a cache hit once the workers wrote it); returns the function that takes it off."""

    def hook(fn, **kwargs):
        if fn.module.startswith(PACKAGE + "."):
            join()

    return _set_hook(hook)


def _set_hook(ours):
    """Set Triton's ``jit_cache_hook`` to ``ours`` and then the hook that was there (unless ``ours`` returns True:
    skip the compile), with a lenient serialiser (``_lenient``); returns the function that takes both off, or, where
    another was set over them meanwhile, leaves them passing everything through."""
    import triton.runtime.jit as jit_module
    from triton import knobs

    previous = knobs.runtime.jit_cache_hook
    serialize = getattr(jit_module, "serialize_specialization_data", None)
    active = [True]

    def hook(**kwargs):
        if active[0] and ours(**kwargs):
            return True
        return previous(**kwargs) if previous is not None else None

    lenient = _lenient(serialize)
    _mark(hook, previous, active)
    _mark(lenient, serialize, active)
    knobs.runtime.jit_cache_hook = hook
    if serialize is not None:
        jit_module.serialize_specialization_data = lenient

    def release():
        active[0] = False
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = _live(previous)
        if serialize is not None and jit_module.serialize_specialization_data is lenient:
            jit_module.serialize_specialization_data = _live(serialize)

    return release


def _mark(function, previous, active: list) -> None:
    """Note on one of our hooks (or serialisers) what it wraps and whether it is still in use (``_live``)."""
    function.hfpaged_previous, function.hfpaged_active = previous, active


def _live(function):
    """``function``, or, where it is one of ours already taken off (another's was set over it, and that one was taken
    off after it), the first live one it wraps: taking two off in the order they were set restores what was there."""
    while function is not None and not getattr(function, "hfpaged_active", [True])[0]:
        function = function.hfpaged_previous
    return function


def _lenient(serialize):
    """``serialize`` returning None where it raises: with a hook set, Triton serialises every compile's
    specialisation to JSON before calling it, in every thread; a kernel with a constant JSON cannot hold (Triton 3.6:
    a jit function passed as constexpr) would raise there, and its compile then goes on without the data."""

    def lenient(*args, **kwargs):
        try:
            return serialize(*args, **kwargs)
        except (TypeError, ValueError):
            return None

    return lenient


def _on(device):
    """``torch.cuda.device(device)`` (a stand-in device without an index: nothing)."""
    import torch

    return torch.cuda.device(device) if device.index is not None else contextlib.nullcontext()


def _cost(job: dict) -> tuple:
    """A guess at a compile's length, to start the long ones first: warps x stages, then the tile's area."""
    data = json.loads(job["data"])
    names = list(data["signature"])
    constants = {names[k[0]]: v for k, v in zip(data["constant_keys"], data["constant_vals"]) if len(k) == 1}
    tile = 1
    for name in ("BLOCK_M", "TILE_N", "BLOCK_N", "HEAD_DIM_PAD"):
        tile *= constants.get(name) if isinstance(constants.get(name), int) else 1
    options = data["options"]
    return (options.get("num_warps", 4) * options.get("num_stages", 1), tile)
