#!/bin/bash
# Session 38, call 1 (one GPU): (1) a warm start's compile phases (s38_warm.py: cold child with fresh caches, then
# two warm children); (2) the GPU suites on session 37's final code, whose last changes had not run on a GPU.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt; nproc > $OUT/nproc.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
C=$(mktemp -d)
for run in cold warm1 warm2; do
  TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor PYTHONPYCACHEPREFIX=$C/pyc \
    timeout 120 python notes/results/session38/s38_warm.py $C/hfpaged > $OUT/warm_$run.log 2>&1
  echo "rc $?" >> $OUT/warm_$run.log
  grep COLD_START $OUT/warm_$run.log | cut -c1-400
done
timeout 400 python -m pytest -q -m gpu -p no:cacheprovider --durations=12 tests/test_compile_ahead.py \
  tests/test_gpu_graphs.py tests/test_gpu_engine.py > $OUT/suites.log 2>&1; echo "rc $?" >> $OUT/suites.log
tail -25 $OUT/suites.log
