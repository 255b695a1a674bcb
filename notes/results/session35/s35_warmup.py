"""Session 35 probe: the Triton kernel warm-up alone (runner.warmup), Qwen3-0.6B shape, bf16, default options, in a
fresh process with an empty Triton cache: its time and the number of kernels it compiled, for HFPAGED_WARMUP_THREADS
set by the caller. python notes/results/session35/s35_warmup.py"""
import os, sys, time

import torch

sys.path.insert(0, "examples")
import benchmark as B  # noqa: E402
import hfpaged  # noqa: E402

model = B.build_model("qwen3-0.6b", torch.bfloat16)
hfpaged.patch(model)
runner = model._hfpaged.engine.runner
t = time.perf_counter()
runner.warmup()
seconds = time.perf_counter() - t
cache = os.environ["TRITON_CACHE_DIR"]
kernels = sum(1 for root, _, files in os.walk(cache) for f in files if f.endswith(".cubin"))
print(f"threads {os.environ.get('HFPAGED_WARMUP_THREADS', '8')}: warm-up {seconds:.1f} s, {kernels} kernels compiled", flush=True)
