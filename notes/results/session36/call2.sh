#!/bin/bash
# Session 36, call 2: the warm-up's Triton compiles in worker processes (kernels/compile_ahead.py): its GPU test and
# the warm-up/graph suites, then the cold start with the workers (default) and without (HFPAGED_WARMUP_PROCESSES=0).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
nproc > $OUT/nproc.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_compile_ahead.py \
  "tests/test_kernels.py::test_warm_up_compiles_every_decode_variant" > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
timeout 190 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --out $OUT/cold_workers \
  > $OUT/cold_workers.log 2>&1; echo "rc $?" >> $OUT/cold_workers.log
HFPAGED_WARMUP_PROCESSES=0 timeout 190 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold \
  --out $OUT/cold_threads > $OUT/cold_threads.log 2>&1; echo "rc $?" >> $OUT/cold_threads.log
python - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/cold_*/benchmark.json")):
    r = json.load(open(f))
    for m in r["results"]:
        for label, v in (m.get("cold_start") or {}).items():
            print(f.split("/")[-2], label, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in v.items()})
PY
grep -h "cold start" $OUT/cold_*.log | cut -c1-300
