"""Session 30: tests/test_gpu_differential.py's cases, many more of them, on the GPU's default fast path.

python notes/results/session30/s30_gpu_fuzz.py FIRST COUNT SECONDS [--all-archs | --more-archs]
runs cases FIRST.. until COUNT ran or SECONDS passed; --all-archs draws the architecture from every model of
tests/models.py's ARCHS (llama, mistral, qwen2, qwen3, gemma2, phi3, gpt2, opt, gpt_neox) instead of three,
--more-archs from its MORE_ARCHS (MoE, MLA, attention sinks, NoPE layers, interleaved windows, ...).
Prints one line per case and a summary; a failing case's drawn settings are printed whole.
"""

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import conftest  # noqa: F401 (the interpreter settings the tests use)
import test_gpu_differential as g
from models import ARCHS, MORE_ARCHS

first, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
archs = tuple(ARCHS) if "--all-archs" in sys.argv else tuple(MORE_ARCHS) if "--more-archs" in sys.argv else None
start = time.perf_counter()
ran, failed = 0, []
for case in range(first, first + count):
    if time.perf_counter() - start > seconds:
        break
    t0 = time.perf_counter()
    try:
        c = g.run_case(case, archs)
        print(f"case {case} {c['arch']} {c['kinds']} ok {time.perf_counter() - t0:.1f}s", flush=True)
    except Exception:
        failed.append(case)
        print(f"case {case} FAILED", flush=True)
        traceback.print_exc()
    ran += 1
print(f"SUMMARY ran={ran} failed={len(failed)} {failed} in {time.perf_counter() - start:.0f}s", flush=True)
