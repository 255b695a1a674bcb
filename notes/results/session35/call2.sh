#!/bin/bash
# Session 35, call 2 (same warm machine as call 1): session 23's tree (25c7516, the README table's code, shipped
# untracked as old35/) on the same chat/churn runs, for a same-machine comparison; then the cold start of today's code.
export PYTHONUNBUFFERED=1
ln -sfn ../kernels hfpaged/kernels
ln -sfn ../kernels old35/hfpaged/kernels
(cd old35 && PYTHONPATH=$PWD timeout 250 python -c "import hfpaged,sys; print(hfpaged.__file__)" > $OUT/old_import.txt 2>&1;
 PYTHONPATH=$PWD timeout 250 python examples/benchmark.py --models qwen3-0.6b llama-3.2-1b --workloads chat churn \
  --sections latency --stock-requests 0 --gb-requests 0 --out $OUT/old > $OUT/old.log 2>&1; echo "rc $?" >> $OUT/old.log)
timeout 300 python examples/benchmark.py --models qwen3-0.6b --workloads --sections cold --out $OUT/cold \
  > $OUT/cold.log 2>&1
echo "rc $?" >> $OUT/cold.log
cat $OUT/old_import.txt
for f in old cold; do echo "== $f"; grep -v "^\s*$" $OUT/$f.log | tail -14 | cut -c1-220; done
