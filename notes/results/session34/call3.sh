#!/bin/bash
# Session 34, call 3 (two GPUs): the GPU suites on the final code (the Ctrl-C deferral's hot-path hooks, the
# server and processor fixes are host code; these run the engine on CUDA with graphs, compile and fp8 around them).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
(CUDA_VISIBLE_DEVICES=0 timeout 540 $T tests/test_gpu_differential.py tests/test_gpu_reliability.py tests/test_leading_rows.py \
   > $OUT/gpu0.log 2>&1; echo "rc $?" >> $OUT/gpu0.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 540 $T tests/test_gpu_graphs.py tests/test_gpu_engine.py tests/test_gpu_gemv.py tests/test_gpu_training.py \
   > $OUT/gpu1.log 2>&1; echo "rc $?" >> $OUT/gpu1.log) &
wait
for f in gpu0 gpu1; do echo "== $f"; tail -5 $OUT/$f.log; done
