#!/bin/bash
# Session 37, call 2 (two GPUs): the warm-up's workers beside the first layer compile.
# Phase 1, both GPUs: the GPU suites that run the new warm-up order (compile_ahead's GPU test, graphs, engine,
# training). Phase 2, GPU 0 alone: cold start, new tree against session 36's (an untracked copy in .s37/old),
# alternating, fresh caches per child, then a warm child each.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
ln -sfn ../kernels .s37/old/hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
(CUDA_VISIBLE_DEVICES=0 timeout 280 $T tests/test_compile_ahead.py tests/test_gpu_graphs.py > $OUT/gpu0.log 2>&1
 echo "rc $?" >> $OUT/gpu0.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 280 $T tests/test_gpu_engine.py tests/test_gpu_training.py > $OUT/gpu1.log 2>&1
 echo "rc $?" >> $OUT/gpu1.log) &
wait
for f in gpu0 gpu1; do echo "== $f"; tail -4 $OUT/$f.log; done
CUDA_VISIBLE_DEVICES=0 timeout 270 python notes/results/session37/s37_cold.py $PWD $PWD/.s37/old 2 $OUT/cold.json \
  > $OUT/cold.log 2>&1
echo "rc $?" >> $OUT/cold.log
tail -12 $OUT/cold.log
