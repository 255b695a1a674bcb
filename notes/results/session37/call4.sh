#!/bin/bash
# Session 37, call 4 (one GPU, the last of the budget): the final compile_ahead on the GPU, TRITON_CACHE_DIR unset
# (the warm-up pins Inductor's directory), then the reliability suite while time is left.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
timeout 110 $T tests/test_compile_ahead.py > $OUT/gpu_compile_ahead.log 2>&1; echo "rc $?" >> $OUT/gpu_compile_ahead.log
tail -2 $OUT/gpu_compile_ahead.log
timeout 75 $T -x tests/test_gpu_reliability.py > $OUT/gpu_reliability.log 2>&1; echo "rc $?" >> $OUT/gpu_reliability.log
tail -2 $OUT/gpu_reliability.log
