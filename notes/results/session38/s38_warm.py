"""Session 38: where a warm start's time goes. benchmark.py's cold-start child (Qwen3-0.6B shape, bf16, default
options), with a timeline: dynamo's compile events, the compile cache's load and save, the kernel warm-up, each
graph's warm-up and capture (seconds since this script's start), then dynamo's phase times. The caller sets the
cache directories (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR) and passes the hfpaged compile cache dir."""

import functools
import os
import sys
import time

T0 = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import torch  # noqa: E402
from torch._dynamo import callback  # noqa: E402

import benchmark  # noqa: E402
from hfpaged.model import compile_cache, cuda_graphs, kernel_warmup, runner  # noqa: E402

events = []


def now():
    return round(time.perf_counter() - T0, 3)


@callback.on_compile_start
def _start(*args):
    events.append(("compile start", now()))


@callback.on_compile_end
def _end(*args):
    events.append(("compile end", now()))


def timed(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = now()
        try:
            return original(*args, **kwargs)
        finally:
            extra = ""
            if name in ("_capture_one", "_warm_up"):
                extra = f" bucket {args[2]}" + (" mixed" if args[0].mixed else "")
            events.append((f"{label}{extra}", start, round(now() - start, 3)))

    setattr(owner, name, wrapper)


timed(compile_cache.CompileCache, "load", "cache load")
timed(compile_cache.CompileCache, "save", "cache save")
timed(kernel_warmup.KernelWarmup, "start", "kernel warm-up start")
timed(kernel_warmup.KernelWarmup, "finish", "kernel warm-up finish")
timed(cuda_graphs.StepGraphs, "_warm_up", "graph warm-up")
timed(cuda_graphs.StepGraphs, "_capture_one", "capture")
timed(runner.ModelRunner if hasattr(runner, "ModelRunner") else runner.Runner, "capture_graphs", "capture_graphs")
events.append(("imports done", now()))
benchmark.cold_start_child("qwen3-0.6b", None, sys.argv[1])
events.append(("child done", now()))
for event in events:
    print("EVENT", *event)
names, values = torch._dynamo.utils.compile_times(repr="csv")
for name, value in zip(names, values):
    if not name.startswith("pass."):
        print(f"  {name}: {value}")
from torch._dynamo.utils import counters  # noqa: E402

print("counters:", {k: dict(v) for k, v in counters.items() if k in ("stats", "inductor", "aot_autograd")})
