#!/bin/bash
# Session 38, call 5 (one GPU, the last ~340 s of the budget): the randomized differential test on the default fast
# path (compiled layers with float constants, CUDA graphs, fused projections; preemption, swap, several callers,
# beam search and n > 1, a weight changed after capture), as many cases as fit.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
timeout 245 python -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_gpu_differential.py > $OUT/diff.log 2>&1
echo "rc $?" >> $OUT/diff.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " $OUT/diff.log | tail -16
