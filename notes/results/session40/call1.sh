#!/bin/bash
# Session 40, call 1: the Gluon engine tests after their shared setup became one helper (session 39's D17 pair);
# the nano-vllm shape and batch-1 latency with today's code (H200: the target is stated for the H100, not lent).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py -k engine > $OUT/gpu_engine.log 2>&1
echo "rc $?" >> $OUT/gpu_engine.log; tail -3 $OUT/gpu_engine.log
timeout 330 python examples/benchmark.py --models qwen3-0.6b --workloads nano --sections latency \
  --gb-requests 0 --stock-requests 0 --out $OUT/nano > $OUT/nano.log 2>&1
echo "rc $?" >> $OUT/nano.log
grep -v "^\s*$" $OUT/nano.log | tail -12 | cut -c1-220
