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

from hfpaged.kernels import argmax, compile_ahead, compile_workers

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
        return chunk.warmup(*args, CHUNK=CHUNK, NO_INDEX=NO_INDEX, num_warps=warps, grid=(1,))
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
bogus_seconds = compile_workers.run_workers([bogus], target, 1)
# workers left running (start_compile_ahead) beside a torch.compile, TRITON_CACHE_DIR unset (as for most users): an
# in-process compile of one of their variants, in another thread, joins them first and then finds their entry, although
# Inductor set TRITON_CACHE_DIR meanwhile (as its first kernel built in a process does where it is unset); the hook is
# then taken off
import os

os.environ.pop("TRITON_CACHE_DIR")
held_hits = []
knobs.compilation.listener = lambda **kw: held_hits.append(kw["cache_hit"])
ahead = compile_ahead.start_compile_ahead(  # four new chunk variants (1 or 2 warps), both row ones: a new directory
    lambda: [launch(r, v, warps=w) for r, v in SHAPES for w in (1, 2)], torch.device("cuda"), processes=2,
    pin_cache_dir=True,
)
held = {"running": ahead.running, "hooked": knobs.runtime.jit_cache_hook is not None}
from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

if os.getenv("TRITON_CACHE_DIR") is None:  # what Inductor's CachingAutotuner does (torch/_inductor/runtime)
    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(0)
joiner = threading.Thread(target=lambda: launch(*SHAPES[1], warmup=True, warps=2))
joiner.start()
joiner.join()
held.update(running_after=ahead.running, hook_after=knobs.runtime.jit_cache_hook, hits=held_hits, stats=ahead.join())
serializer_restored = jit_module.serialize_specialization_data is strict_serialize
# workers never joined, still running when this process exits: killed with it (four chunk variants, 8 or 16 warps)
abandoned = compile_ahead.start_compile_ahead(
    lambda: [launch(r, v, warps=w) for r, v in SHAPES for w in (8, 16)], torch.device("cuda"), processes=2
)
abandoned_pids = [proc.pid for proc in abandoned._workers.procs] if abandoned.running else []
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
    "serializer_restored": serializer_restored, "hits": hits, "other_compiled": other["kernel"] is not None,
    "recording_in_launch_all": other["in_run_all"], "recording_after": compile_ahead.recording(),
    "previous_hook_calls": previous_calls, "hook_restored": hook_after is not None and hook_after.__name__ == "<lambda>",
    "held": held, "abandoned_pids": abandoned_pids,
}))
"""


def test_compiles_in_workers_are_the_jit_paths_cache_hits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    # where Triton's own default and Inductor's directory lie once the script unsets TRITON_CACHE_DIR
    env.update(TRITON_HOME=str(tmp_path / "home"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
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
    # workers left running (six variants: TRITON_CACHE_DIR was unset, and is now Inductor's): the hook was set while they ran; another thread's compile of one of their variants
    # joined them (they are done, the hook is off) and was a cache hit
    held = result["held"]
    assert held["running"] is True and held["hooked"] is True, held
    assert held["running_after"] is False and held["hook_after"] is None and held["hits"] == [True], held
    stats = held["stats"]
    assert (stats["recorded"], stats["missing"], stats["workers"], stats["still_missing"]) == (6, 6, 2, 0), stats
    assert stats["join_wait_s"] >= 0 and stats["joined_after_s"] >= 0 and stats["compile_s"] > 0, stats
    # workers still compiling when the script ended: none outlived it
    assert len(result["abandoned_pids"]) == 2
    assert not [pid for pid in result["abandoned_pids"] if _running(pid)], result["abandoned_pids"]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # a zombie has ended
    except FileNotFoundError:
        return False


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
import json, os, sys
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
warm = runner.kernel_warmup
ours = []  # (cache hit, during the warm-up's own pass) of each compile of our kernels in this process
in_pass = [False]
knobs.compilation.listener = lambda **kw: ours.append((kw["cache_hit"], in_pass[0])) if getattr(
    getattr(kw["src"], "fn", None), "module", "").startswith("hfpaged.kernels") else None
launch_all = warm._launch_all


def own_pass():
    in_pass[0] = True
    launch_all()
    in_pass[0] = False


warm._launch_all = own_pass
results = model.generate_many(prompts, max_new_tokens=16, do_sample=False)
print(json.dumps({"stats": warm.stats, "ours": ours, "parity": [r.token_ids for r in results] == expected,
                  "cache_dir": os.environ.get("TRITON_CACHE_DIR")}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_runner_warm_up_compiles_in_workers_then_only_hits(tmp_path):
    from hfpaged.kernels import compile_ahead

    # A fresh process with an empty Triton cache, compiled layers (the CUDA default): the runner's warm-up records its
    # variants and leaves the workers running beside the first layer compile; they are joined before that forward
    # compiles any of our kernels here, so its first such compile is a cache hit (not done twice), and so is every
    # compile of the warm-up's own pass after it; tokens as stock generate's.
    # TRITON_CACHE_DIR unset, as for most users: Inductor sets it at its first kernel built in the process (where it is
    # unset), while the workers run; the warm-up pins it first (Inductor's directory, under TORCHINDUCTOR_CACHE_DIR)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(TRITON_HOME=str(tmp_path / "home"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    env["HFPAGED_WARMUP_PROCESSES"] = "4"
    script = tmp_path / "script.py"
    script.write_text(GPU_SCRIPT)
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, str(script), tests], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    stats = result["stats"]
    assert stats["recorded"] >= compile_ahead.MIN_JOBS and stats["missing"] == stats["recorded"], stats
    assert stats["workers"] == 4 and stats["still_missing"] == 0 and "joined_after_s" in stats, stats
    ours = result["ours"]
    assert ours and ours[0] == [True, False], ours  # the layer compile's forward: joined, then a hit
    in_pass = [hit for hit, during in ours if during]
    assert in_pass and all(in_pass), ours
    assert result["parity"] is True
    assert result["cache_dir"] == str(tmp_path / "inductor" / "triton" / "0")


class _FakeAhead:
    def __init__(self, running):
        self.running, self.started, self.stats, self.joins = running, 0.0, {"workers": 2 if running else 0}, 0

    def join(self):
        self.joins += 1
        self.running = False
        return self.stats


@pytest.mark.parametrize("overlap", [True, False])
def test_kernel_warm_up_joins_once_and_launches_once(monkeypatch, overlap):
    # The runner's warm-up (hfpaged/model/kernel_warmup.py) without a GPU: workers left running with compiled layers
    # (overlap); finish(launch=False) (drop_graphs) joins them only; the warm-up's own launches run once, at the first
    # finish() that may launch; without overlap start() finishes at once.
    import types

    import torch

    from hfpaged.kernels import compile_ahead
    from hfpaged.model import kernel_warmup

    aheads, launches, pins = [], [], []
    monkeypatch.setattr(
        compile_ahead,
        "start_compile_ahead",
        lambda launch_all, device, pin_cache_dir: (
            pins.append(pin_cache_dir) or aheads.append(_FakeAhead(True)) or aheads[-1]
        ),
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    state = types.SimpleNamespace(use_triton=True)
    warm = kernel_warmup.KernelWarmup(state, torch.device("cuda", 0))
    monkeypatch.setattr(warm, "_launch_all", lambda: launches.append(1))
    warm.start(overlap=overlap)
    assert warm.started and len(aheads) == 1 and pins == [overlap]  # TRITON_CACHE_DIR pinned beside torch.compile
    if overlap:
        assert (aheads[0].joins, launches) == (0, [])  # the workers run on beside the layer compile
        warm.finish(launch=False)
        assert (aheads[0].joins, launches) == (1, [])
    warm.finish()
    warm.finish()
    assert (aheads[0].joins, launches) == (1, [1])
    assert warm.seconds >= 0


def test_hooks_taken_off_in_the_order_they_were_set_restore_what_was_there():
    # two warm-ups holding compiles at once (two models), joined first-started first: the second's release used to put
    # back the first's hook (and serialiser), already taken off, for good
    import triton.runtime.jit as jit_module
    from triton import knobs

    from hfpaged.kernels import compile_ahead

    original_hook, original_serialize = knobs.runtime.jit_cache_hook, jit_module.serialize_specialization_data
    try:
        release_first = compile_ahead._hold_compiles(lambda: None)
        release_second = compile_ahead._hold_compiles(lambda: None)
        release_first()
        release_second()
        assert knobs.runtime.jit_cache_hook is original_hook
        assert jit_module.serialize_specialization_data is original_serialize
    finally:
        knobs.runtime.jit_cache_hook, jit_module.serialize_specialization_data = original_hook, original_serialize
