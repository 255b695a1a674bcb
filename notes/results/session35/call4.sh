#!/bin/bash
# Session 35, call 4 (nvidia-h100-x1): the README's chat/churn benchmark on the session's final code, 5 timed runs per
# workload (call 1's hosts varied more between runs of 3 than the code moved them); then the GPU reliability suites again.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 400 python examples/benchmark.py --models qwen3-0.6b llama-3.2-1b --workloads chat churn \
  --sections latency generate_batch --gb-requests 256 --stock-requests 0 --repeats 5 --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc $?" >> $OUT/bench.log
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_reliability.py tests/test_async_scheduling.py \
  > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
grep -h "hfpaged:\|per step\|waited\|generate_batch (" $OUT/bench.log | cut -c1-200
grep -v "^\s*$" $OUT/bench.log | tail -9
