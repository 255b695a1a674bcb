#!/bin/bash
# Session 35, call 1: the README's benchmark commands on today's code (issue 12 asks for the performance table
# re-measured with the final code; ten sessions of host-side reliability work since session 23's figures).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 330 python examples/benchmark.py --models qwen3-0.6b llama-3.2-1b --workloads chat churn \
  --sections latency generate_batch --gb-requests 256 --stock-requests 0 --out $OUT/bench > $OUT/bench.log 2>&1
echo "rc $?" >> $OUT/bench.log
timeout 230 python examples/benchmark.py --models qwen3-0.6b --workloads long nano --sections prefill latency \
  --out $OUT/nano > $OUT/nano.log 2>&1
echo "rc $?" >> $OUT/nano.log
for f in bench nano; do echo "== $f"; grep -v "^\s*$" $OUT/$f.log | tail -14 | cut -c1-220; done
