#!/bin/bash
# Session 40, call 2: Llama-3.1-8B chat side by side with generate_batch on today's code (last measured in session 23).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 520 python examples/benchmark.py --models llama-3.1-8b --workloads chat --sections latency generate_batch \
  --gb-requests 256 --stock-requests 0 --out $OUT/bench8b > $OUT/bench8b.log 2>&1
echo "rc $?" >> $OUT/bench8b.log
grep -v "^\s*$" $OUT/bench8b.log | tail -14 | cut -c1-220
