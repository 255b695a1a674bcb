"""The worker processes of ``compile_ahead.py``: each compiles recorded Triton variants into Triton's on-disk cache.

A worker is ``python -c`` (no import of the caller's ``__main__``, no CUDA): it loads only this package, torch and
Triton, takes the next job nobody has claimed (a file made exclusively beside the job list), rebuilds its source as
Triton's ``JITFunction.preload`` does, and compiles it for the recorded target. A failure is printed and the rest go
on (the caller compiles that variant itself). Each worker leads a session of its own, so that killing it takes its
``ptxas`` along.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import weakref

logger = logging.getLogger("hfpaged")
PACKAGE = __name__.rpartition(".")[0]  # hfpaged.kernels


def source(job: dict, backend):
    """(ASTSource, options) of a recorded compile, rebuilt as Triton's ``JITFunction.preload`` rebuilds it."""
    import importlib

    import triton.language as tl
    from triton.compiler import ASTSource

    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(tuples(value["constexpr"]))
        return tuples(value)

    data = json.loads(job["data"])
    fn = getattr(importlib.import_module(job["module"]), job["name"])
    constants = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: tuples(v) for k, v in data["signature"].items()}
    options = backend.parse_options({k: tuples(v) for k, v in data["options"].items()})
    return ASTSource(fn, signature, constants, attrs), options


_BOOT = """
import importlib.util, os, sys, types
package, package_dir = sys.argv[1], sys.argv[2]
parts = package.split(".")
for i in range(1, len(parts)):  # the parents as empty packages: no import of hfpaged (transformers) here
    sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i]))).__path__ = []
spec = importlib.util.spec_from_file_location(
    package, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])
module = importlib.util.module_from_spec(spec)
sys.modules[package] = module
spec.loader.exec_module(module)
importlib.import_module(package + ".compile_workers")._worker(sys.argv[3])
"""


def run_workers(jobs: list[dict], target, workers: int) -> list[float]:
    """Compile ``jobs`` in ``workers`` processes, each taking the next unclaimed job in order; the seconds each
    compile took (failed ones excluded)."""
    return Workers(jobs, target, workers).wait()


class Workers:
    """``count`` worker processes started on ``jobs`` (each takes the next unclaimed job in order); ``wait()``."""

    def __init__(self, jobs: list[dict], target, count: int):
        package_dir = os.path.dirname(os.path.abspath(__file__))
        self._tmp = tempfile.TemporaryDirectory(prefix="hfpaged-compile-")
        self.procs: list[subprocess.Popen] = []
        # at interpreter exit (a program stopped during its first layer compile) no worker outlives it either
        self._at_exit = weakref.finalize(self, _kill, self.procs)
        try:
            path = os.path.join(self._tmp.name, "jobs.json")
            with open(path, "w") as f:
                json.dump({"target": target.__dict__, "jobs": jobs}, f)
            for i in range(count):
                cmd = [sys.executable, "-c", _BOOT, PACKAGE, package_dir, path]
                with open(self._log(i), "w") as log:  # the child keeps its own descriptor
                    # a session of its own: an interrupted caller kills the worker with its ptxas (_kill)
                    self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        except BaseException:
            self._at_exit()
            self._tmp.cleanup()
            raise

    def _log(self, i: int) -> str:
        return os.path.join(self._tmp.name, f"worker{i}.log")

    def wait(self) -> list[float]:
        """Wait for every worker; the seconds each compile took (failed ones excluded)."""
        try:
            try:
                for proc in self.procs:
                    proc.wait()
            finally:
                self._at_exit()  # the caller was interrupted: no worker outlives it
            seconds = []
            for i, proc in enumerate(self.procs):
                with open(self._log(i)) as f:
                    text = f.read()
                seconds += [
                    float(line.split()[2]) for line in text.splitlines() if line.startswith("hfpaged-compiled ")
                ]
                if proc.returncode != 0:
                    logger.debug("hfpaged: compile worker %d exited with %s:\n%s", i, proc.returncode, text[-2000:])
            return seconds
        finally:
            self._tmp.cleanup()


def _kill(procs: list) -> None:
    """Kill the workers still running, with their ptxas (each leads a session of its own)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _worker(path: str) -> None:
    """A worker process: compile the jobs no other worker has claimed (a claim is a file made exclusively beside
    the job list), in the list's order, into Triton's cache; a failure is printed and the rest go on (the caller
    compiles that variant itself)."""
    import time
    import traceback

    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.compiler.compiler import make_backend

    with open(path) as f:
        spec = json.load(f)
    target = GPUTarget(**spec["target"])
    backend = make_backend(target)
    failed = 0
    for j, job in enumerate(spec["jobs"]):
        try:
            os.close(os.open(f"{path}.claim{j}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        start = time.perf_counter()
        try:
            src, options = source(job, backend)
            triton_compile(src, target=target, options=options.__dict__)
            print(f"hfpaged-compiled {j} {time.perf_counter() - start:.3f}", flush=True)
        except Exception:
            failed += 1
            traceback.print_exc()
    sys.exit(1 if failed else 0)
