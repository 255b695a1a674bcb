"""Session 37: cold start, the warm-up's workers beside the first layer compile (new) against joined before it (old).

Runs benchmark.py's cold-start child (Qwen3-0.6B shape, bf16, default options: patch -> first result of 8 chat
prompts) from two trees, alternating, each child with fresh Triton, Inductor and hfpaged caches; then one warm child
per tree on the caches its last cold child filled. Usage: python s37_cold.py NEW_ROOT OLD_ROOT REPS OUT_JSON
[WARM(0/1)] [OLD_ENV]: OLD_ENV (e.g. HFPAGED_WARMUP_PROCESSES=8) is set for the "old" children only (call 3 runs the
new tree as both, the worker count differing).
"""

import json
import os
import subprocess
import sys
import tempfile

new_root, old_root, reps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
warm = len(sys.argv) <= 5 or sys.argv[5] == "1"
old_env = dict([sys.argv[6].split("=", 1)]) if len(sys.argv) > 6 else {}
pyc = tempfile.mkdtemp(prefix="pyc-")
base = dict(os.environ, PYTHONPYCACHEPREFIX=pyc)
base.pop("PYTHONDONTWRITEBYTECODE", None)
# fill the bytecode cache of torch's modules once, so that no tree's first child pays it alone
subprocess.run(
    [sys.executable, "-c", "import torch, transformers, torch._dynamo, torch._inductor.compile_fx"], env=base
)


def child(root, caches, extra):
    env = dict(
        base,
        **extra,
        TRITON_CACHE_DIR=caches + "/triton",
        TORCHINDUCTOR_CACHE_DIR=caches + "/inductor",
        PYTHONPATH=root,
    )
    check = subprocess.run(
        [sys.executable, "-c", "import hfpaged; print(hfpaged.__file__)"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert check.stdout.startswith(root), (root, check.stdout, check.stderr[-2000:])
    cmd = [
        sys.executable,
        "examples/benchmark.py",
        "--cold-start-child",
        "qwen3-0.6b",
        "--compile-cache-dir",
        caches + "/hfpaged",
    ]
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("COLD_START ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return json.loads(lines[-1][len("COLD_START ") :])


results = {"new": [], "old": [], "new_warm": None, "old_warm": None}
last = {}
for rep in range(reps):
    for label, root in (
        (("old", old_root), ("new", new_root)) if rep % 2 == 0 else (("new", new_root), ("old", old_root))
    ):
        caches = tempfile.mkdtemp(prefix=f"{label}{rep}-")
        r = child(root, caches, old_env if label == "old" else {})
        results[label].append(r)
        last[label] = (root, caches)
        print(
            label,
            rep,
            json.dumps(
                {
                    k: r[k]
                    for k in (
                        "patch_to_first_result_s",
                        "kernel_warmup_s",
                        "capture_mixed_s",
                        "capture_decode_s",
                        "dynamo_compile_s",
                        "kernel_warmup_processes",
                    )
                }
            ),
            flush=True,
        )
for label in ("new", "old") if warm else ():
    root, caches = last[label]
    r = child(root, caches, old_env if label == "old" else {})
    results[label + "_warm"] = r
    print(
        label,
        "warm",
        json.dumps(
            {
                k: r[k]
                for k in (
                    "patch_to_first_result_s",
                    "kernel_warmup_s",
                    "capture_mixed_s",
                    "capture_decode_s",
                    "dynamo_compile_s",
                )
            }
        ),
        flush=True,
    )
with open(out, "w") as f:
    json.dump(results, f, indent=1)
for label in ("new", "old"):
    xs = sorted(r["patch_to_first_result_s"] for r in results[label])
    print(
        label,
        "cold patch->first result:",
        [round(x, 1) for x in xs],
        "warm:",
        results[label + "_warm"] and round(results[label + "_warm"]["patch_to_first_result_s"], 1),
    )
