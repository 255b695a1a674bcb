#!/bin/bash
# Session 40, call 7: the nested-step GPU tests on the session's final code.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_nested_generation.py > $OUT/nested.log 2>&1
echo "rc $?" >> $OUT/nested.log; grep -E "passed|failed|^FAILED|^E " $OUT/nested.log | head -20
