#!/bin/bash
# Session 38, call 4 (one GPU), the final code: (1) benchmark.py's cold start (empty caches, warm caches, hfpaged
# compile cache only); (2) Qwen3-0.6B chat and batch-1 latency with the defaults (the float constants' steady state);
# (3) the batch-1 GEMV suite (its norm fusion reads eps, now a constant of the trace) and the mixed-graph replays.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt; nproc > $OUT/nproc.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
timeout 200 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --out $OUT/cold \
  > $OUT/cold.log 2>&1; echo "rc $?" >> $OUT/cold.log
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/cold/benchmark.json"))
for m in r["results"]:
    for label, v in (m.get("cold_start") or {}).items():
        print(label, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in v.items() if k != "kernel_warmup_processes"})
PY
timeout 170 python examples/benchmark.py --models qwen3-0.6b --workloads chat --sections latency --gb-requests 0 \
  --stock-requests 0 --repeats 3 --out $OUT/chat > $OUT/chat.log 2>&1; echo "rc $?" >> $OUT/chat.log
grep -iE "tok/s|ms/token|rc " $OUT/chat.log | tail -8
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_gemv.py tests/test_gpu_graphs.py -k "gemv or mixed_steps_replay or dependent" > $OUT/gemv.log 2>&1
echo "rc $?" >> $OUT/gemv.log; tail -3 $OUT/gemv.log
