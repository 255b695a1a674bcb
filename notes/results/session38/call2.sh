#!/bin/bash
# Session 38, call 2 (one GPU): (1) the warm start's timeline with float constants (s38_warm.py: a cold child with
# fresh caches, two warm children, a third under py-spy); (2) the GPU graph suites on compiled layers with float
# constants.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
python -m pip install -q --no-deps notes/results/session38/py_spy-*.whl  # (the wheel, py-spy 0.4.3 from PyPI, was shipped untracked) > $OUT/pyspy_install.log 2>&1
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt; nproc > $OUT/nproc.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
C=$(mktemp -d)
for run in cold warm1 warm2; do
  TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor PYTHONPYCACHEPREFIX=$C/pyc \
    timeout 120 python notes/results/session38/s38_warm.py $C/hfpaged > $OUT/warm_$run.log 2>&1
  echo "rc $?" >> $OUT/warm_$run.log
  grep COLD_START $OUT/warm_$run.log | cut -c1-300
done
TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor PYTHONPYCACHEPREFIX=$C/pyc \
  timeout 120 py-spy record -r 250 -f raw -o $OUT/warm_spy.txt -- python notes/results/session38/s38_warm.py \
  $C/hfpaged > $OUT/warm_spy.log 2>&1; echo "rc $?" >> $OUT/warm_spy.log
tail -3 $OUT/warm_spy.log
timeout 300 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_gpu_graphs.py \
  tests/test_gpu_engine.py -k "graphs or compiled" > $OUT/suites.log 2>&1; echo "rc $?" >> $OUT/suites.log
tail -12 $OUT/suites.log
