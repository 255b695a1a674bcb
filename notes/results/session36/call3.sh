#!/bin/bash
# Session 36, call 3: the worker-process compiles with a heavy-first, claim-as-you-go job order and up to 16
# workers: the GPU tests, the cold start with workers and without (A/B on one host), the long workload's prefill.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_compile_ahead.py \
  "tests/test_kernels.py::test_warm_up_compiles_every_decode_variant" > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
timeout 160 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --out $OUT/cold_workers \
  > $OUT/cold_workers.log 2>&1; echo "rc $?" >> $OUT/cold_workers.log
HFPAGED_WARMUP_PROCESSES=0 timeout 160 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold \
  --out $OUT/cold_threads > $OUT/cold_threads.log 2>&1; echo "rc $?" >> $OUT/cold_threads.log
timeout 100 python examples/benchmark.py --models qwen3-0.6b --workloads long --sections prefill --out $OUT/prefill \
  > $OUT/prefill.log 2>&1; echo "rc $?" >> $OUT/prefill.log
python - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/cold_*/benchmark.json")):
    for m in json.load(open(f))["results"]:
        for label, v in (m.get("cold_start") or {}).items():
            print(f.split("/")[-2], label, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in v.items()})
PY
grep -h "cold start\|prefill of" $OUT/*.log | cut -c1-300
