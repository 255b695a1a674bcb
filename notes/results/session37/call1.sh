#!/bin/bash
# Session 37, call 1 (two GPUs): the GPU suites on session 36's final code (its last host-side fixes were not
# GPU-tested: abort fallback, unpatch lock, ModelUnpatched, eval_mode submodules, prompt ids; test_gpu_graphs ran
# only 3 tests).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
(CUDA_VISIBLE_DEVICES=0 timeout 520 $T tests/test_gpu_graphs.py tests/test_gpu_engine.py tests/test_gpu_training.py \
   tests/test_compile_ahead.py > $OUT/gpu0.log 2>&1; echo "rc $?" >> $OUT/gpu0.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 520 $T tests/test_gpu_reliability.py tests/test_async_scheduling.py \
   tests/test_gpu_differential.py tests/test_gpu_gemv.py tests/test_gpu_fused_projections.py tests/test_fp8_engine.py \
   > $OUT/gpu1.log 2>&1; echo "rc $?" >> $OUT/gpu1.log) &
wait
for f in gpu0 gpu1; do echo "== $f"; tail -8 $OUT/$f.log; done
