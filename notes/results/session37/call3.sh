#!/bin/bash
# Session 37, call 3 (one H100): the workers beside the layer compile, on the README's kind of host.
# 1. 16 workers (the default) against 8 (HFPAGED_WARMUP_PROCESSES=8), alternating, fresh caches per child;
# 2. benchmark.py's cold section (empty caches, warm caches, hfpaged compile cache only) with the defaults.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
nproc > $OUT/nproc.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
timeout 210 python notes/results/session37/s37_cold.py $PWD $PWD 2 $OUT/workers.json 0 HFPAGED_WARMUP_PROCESSES=8 \
  > $OUT/workers.log 2>&1; echo "rc $?" >> $OUT/workers.log
tail -3 $OUT/workers.log
timeout 200 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --out $OUT/cold \
  > $OUT/cold.log 2>&1; echo "rc $?" >> $OUT/cold.log
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/cold/benchmark.json"))
for m in r["results"]:
    for label, v in (m.get("cold_start") or {}).items():
        print(label, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in v.items()})
PY
tail -2 $OUT/cold.log
