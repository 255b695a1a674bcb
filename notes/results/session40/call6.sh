#!/bin/bash
# Session 40, call 6: a generate_many nested in a step (processor, stopping criterion) with default options on CUDA
# (graphs, compiled layers, overlapped steps), on the final nested-step code; the reliability and overlapped-step suites beside it.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt
T="python -m pytest -q -p no:cacheprovider -m gpu -rA"
timeout 200 $T tests/test_nested_generation.py > $OUT/nested.log 2>&1; echo "rc $?" >> $OUT/nested.log
grep -E "passed|failed|^FAILED|^E " $OUT/nested.log | head -20
timeout 330 $T tests/test_gpu_reliability.py tests/test_async_scheduling.py > $OUT/rel.log 2>&1; echo "rc $?" >> $OUT/rel.log
grep -E "passed|failed|^FAILED|rc " $OUT/rel.log | tail -5
