#!/bin/bash
# Session 36, call 4: the final compile_ahead (the review's mends) on the GPU: its test (fresh process, empty Triton
# cache, every compile of the runner's own pass a cache hit, tokens equal to stock generate), then the graph suite.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_compile_ahead.py > $OUT/gpu_compile_ahead.log 2>&1
echo "rc $?" >> $OUT/gpu_compile_ahead.log
timeout 120 python -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_graphs.py > $OUT/gpu_graphs.log 2>&1
echo "rc $?" >> $OUT/gpu_graphs.log
tail -3 $OUT/gpu_compile_ahead.log $OUT/gpu_graphs.log
