"""The warm-up's Triton compiles in worker processes (kernels/compile_ahead.py), checked without a GPU.

Triton compiles for the H100 (sm_90) on the CPU; only launching needs the device. The script below runs in its own
process with compiled (not interpreted) kernels and a stand-in Triton driver that names an sm_90 target: the
argmax kernels' launches are recorded (nothing compiled or launched), compiled by worker processes into a fresh
cache, and the real JIT path then finds every one of them there. The GPU test of the whole warm-up (every compile of
the runner's own pass a cache hit) is the last test here.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys, threading
import torch, triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class StandIn:  # what JITFunction.run asks of the driver before it compiles
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(StandIn())
import triton.runtime.jit as jit_module

from hfpaged.kernels import argmax, compile_ahead

# Triton 3.6 cannot serialise some constants (a jit function passed as constexpr) and raises TypeError; 3.9 can.
# This serialiser does the same for any fp16 variant, the other thread's below.
original_serialize = jit_module.serialize_specialization_data


def strict_serialize(name, signature, *args, **kwargs):
    if any("fp16" in str(v) for v in signature.values()):
        raise TypeError("Object of type JITFunction is not JSON serializable")
    return original_serialize(name, signature, *args, **kwargs)


jit_module.serialize_specialization_data = strict_serialize

CHUNK, NO_INDEX = argmax.CHUNK, argmax._NO_INDEX
SHAPES = ((3, 5000), (7, 70000))


def launch(rows, vocab, warmup=False, dtype=torch.float32, chunk_kernel=True, warps=4):
    x = torch.randn(rows, vocab, dtype=dtype)
    n = triton.cdiv(vocab, CHUNK)
    top, index = torch.empty(rows, n), torch.empty(rows, n, dtype=torch.int32)
    out = torch.empty(rows, dtype=torch.int64)
    chunk = argmax._chunk_argmax_kernel
    row = argmax._row_argmax_kernel
    args = (x, top, index, vocab, n, x.stride(0))
    if warmup:  # compiles without launching (the stand-in driver cannot launch)
        return chunk.warmup(*args, CHUNK=CHUNK, NO_INDEX=NO_INDEX, num_warps=4, grid=(1,))
    if chunk_kernel:
        chunk[(rows, n)](*args, CHUNK=CHUNK, NO_INDEX=NO_INDEX, num_warps=warps)
    row[(rows,)](top, index, out, n, CHUNKS_PAD=16 if n <= 16 else 64, NO_INDEX=NO_INDEX, num_warps=4)


other = {}


def launch_all():
    for rows, vocab in SHAPES:
        launch(rows, vocab)
    # another thread's compile meanwhile is its own: compiled, not recorded (a variant of its own: fp16)
    t = threading.Thread(target=lambda: other.setdefault("kernel", launch(5, 100, True, torch.float16)))
    t.start()
    t.join()
    other["in_run_all"] = compile_ahead.recording()


previous_calls = []
knobs.runtime.jit_cache_hook = lambda **kw: previous_calls.append(kw["fn"].name)
stats = compile_ahead.compile_ahead(launch_all, torch.device("cuda"), processes=2)
hook_after = knobs.runtime.jit_cache_hook
knobs.runtime.jit_cache_hook = None
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
for rows, vocab in SHAPES:
    launch(rows, vocab, warmup=True)
# the chunk kernels are compiled in this process now (they would launch): the row kernels' launches only
again = compile_ahead.compile_ahead(
    lambda: [launch(rows, vocab, chunk_kernel=False) for rows, vocab in SHAPES], torch.device("cuda"), processes=2
)
target = driver.active.get_current_target()
bogus = {"module": "hfpaged.kernels.argmax", "name": "_row_argmax_kernel", "data": "{}"}
bogus_seconds = compile_ahead._run_workers([bogus], target, 1)
# workers that cannot start: nothing raised, every variant left to the caller's pass
import subprocess


def no_popen(*args, **kwargs):
    raise PermissionError(13, "Permission denied")


subprocess.Popen = no_popen
unstarted = compile_ahead.compile_ahead(  # four new chunk variants (bf16, 4 or 8 warps)
    lambda: [launch(r, v, dtype=torch.bfloat16, warps=w) for r, v in SHAPES for w in (4, 8)],
    torch.device("cuda"),
    processes=2,
)
print(json.dumps({
    "stats": stats, "again": again, "bogus_seconds": bogus_seconds, "unstarted": unstarted,
    "serializer_restored": jit_module.serialize_specialization_data is strict_serialize, "hits": hits, "other_compiled": other["kernel"] is not None,
    "recording_in_launch_all": other["in_run_all"], "recording_after": compile_ahead.recording(),
    "previous_hook_calls": previous_calls, "hook_restored": hook_after is not None and hook_after.__name__ == "<lambda>",
}))
"""


def test_compiles_in_workers_are_the_jit_paths_cache_hits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # two shapes x two kernels recorded, none in the fresh cache, both workers used, nothing left missing
    stats = result["stats"]
    assert {k: stats[k] for k in ("recorded", "missing", "workers", "still_missing")} == {
        "recorded": 4,
        "missing": 4,
        "workers": 2,
        "still_missing": 0,
    }
    assert 0 < stats["slowest_compile_s"] <= stats["compile_s"]
    # the JIT path's own compiles of the chunk kernel (the row kernel's need its launch) hit the workers' entries
    assert result["hits"] == [True, True]
    # a second warm-up of the row kernels: their entries are on disk, no worker starts
    assert result["again"] == {
        "recorded": 2,
        "missing": 0,
        "workers": 0,
        "still_missing": 0,
        "slowest_compile_s": 0.0,
        "compile_s": 0.0,
    }
    # the other thread compiled for real, through the hook that was there before (called for it, not for ours)
    assert result["other_compiled"] is True
    assert result["previous_hook_calls"] == ["_chunk_argmax_kernel"]
    assert result["recording_in_launch_all"] is True and result["recording_after"] is False
    assert result["hook_restored"] is True
    assert result["bogus_seconds"] == []  # a job that fails in its worker is left to the caller, nothing raised
    # the other thread's compile went on although its specialisation could not be serialised
    assert result["serializer_restored"] is True
    unstarted = result["unstarted"]
    assert unstarted["missing"] >= 4 and unstarted["still_missing"] == unstarted["missing"], unstarted


def test_processes_setting_is_checked(monkeypatch):
    from hfpaged.kernels import compile_ahead

    monkeypatch.setenv("HFPAGED_WARMUP_PROCESSES", "four")
    with pytest.raises(ValueError, match="HFPAGED_WARMUP_PROCESSES must be a non-negative integer, got 'four'"):
        compile_ahead._processes_from_env()
    monkeypatch.setenv("HFPAGED_WARMUP_PROCESSES", "0")
    assert compile_ahead._processes_from_env() == 0


def test_off_the_gpu_nothing_is_recorded():
    import torch

    from hfpaged.kernels import compile_ahead

    calls = []
    stats = compile_ahead.compile_ahead(lambda: calls.append(1), torch.device("cpu"))
    assert stats["recorded"] == stats["workers"] == 0
    assert calls == []  # the caller's own pass runs the launches


GPU_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from models import make_model, random_prompts, reference_generate
from triton import knobs

import hfpaged

model = make_model("qwen3").cuda()
prompts = random_prompts([5, 17, 40, 9], seed=7)
expected = reference_generate(model, prompts, max_new_tokens=16, do_sample=False)
hfpaged.patch(model, num_blocks=64, block_size=8, max_num_seqs=8)
runner = model._hfpaged.engine.runner
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
runner.warmup()  # its own pass: every Triton compile should find the workers' entry
warmup_hits = list(hits)
results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
print(json.dumps({"stats": runner.compile_ahead, "warmup_hits": warmup_hits,
                  "parity": [r.token_ids for r in results] == expected}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_runner_warm_up_compiles_in_workers_then_only_hits(tmp_path):
    from hfpaged.kernels import compile_ahead

    # A fresh process with an empty Triton cache: the runner's warm-up records its variants, the workers compile
    # all of them, and its own pass then compiles nothing (every compile a cache hit); tokens as stock generate's.
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), HFPAGED_WARMUP_PROCESSES="4")
    script = tmp_path / "script.py"
    script.write_text(GPU_SCRIPT)
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, str(script), tests], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert stats["recorded"] >= compile_ahead.MIN_JOBS and stats["missing"] == stats["recorded"], stats
    assert stats["workers"] == 4 and stats["still_missing"] == 0, stats
    assert result["warmup_hits"] and all(result["warmup_hits"]), result["warmup_hits"]
    assert result["parity"] is True
