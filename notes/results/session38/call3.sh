#!/bin/bash
# Session 38, call 3 (one GPU): where the cold and warm starts spend the time before the first compile: a cold child
# and a warm child of s38_warm.py under py-spy (wall time, idle included, per thread), raw stacks gzipped.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
python -m pip install -q --no-deps notes/results/session38/py_spy-*.whl  # (the wheel, py-spy 0.4.3 from PyPI, was shipped untracked) > $OUT/pyspy_install.log 2>&1
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt; nproc > $OUT/nproc.txt
git log -1 --format=%H > $OUT/commit.txt; git status --short >> $OUT/commit.txt
C=$(mktemp -d)
for run in cold warm; do
  TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor PYTHONPYCACHEPREFIX=$C/pyc \
    timeout 150 py-spy record -r 200 --idle --threads -f raw -o $OUT/spy_$run.txt -- \
    python notes/results/session38/s38_warm.py $C/hfpaged > $OUT/spy_$run.log 2>&1
  echo "rc $?" >> $OUT/spy_$run.log
  gzip -9 $OUT/spy_$run.txt
  grep COLD_START $OUT/spy_$run.log | cut -c1-200
done
ls -la $OUT
