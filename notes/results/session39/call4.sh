#!/bin/bash
# Session 39, call 4: the rest of the fresh-prompt GPU tests; the long workload's prefill and decode with the Gluon
# kernel off, then on (benchmark.py, one process each); the cold/warm start with it on.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py -k "replay or engine or ignore" > $OUT/gpu_fresh2.log 2>&1; echo "rc $?" >> $OUT/gpu_fresh2.log
tail -4 $OUT/gpu_fresh2.log
for g in 0 1; do
  HFPAGED_GLUON_PROMPTS=$g timeout 200 python examples/benchmark.py --models qwen3-0.6b --workloads long --sections prefill \
    --gb-requests 0 --stock-requests 0 --out $OUT/long_gluon$g > $OUT/long_gluon$g.log 2>&1; echo "rc $?" >> $OUT/long_gluon$g.log
  grep -i "prefill\|long\|rc " $OUT/long_gluon$g.log | tail -8
done
timeout 200 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --gb-requests 0 --stock-requests 0 \
  --out $OUT/cold > $OUT/cold.log 2>&1; echo "rc $?" >> $OUT/cold.log
grep -i "cold\|warm\|rc " $OUT/cold.log | tail -8
