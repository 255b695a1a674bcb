#!/bin/bash
# Session 35, call 6 (nvidia-h100-x1): the kernel warm-up alone with 8 threads (the default) and 16 (the host's
# cores), alternating, each in a fresh process with an empty Triton cache.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nproc > $OUT/nproc.txt
for round in 1 2; do
  for threads in 8 16; do
    d=$(mktemp -d)
    TRITON_CACHE_DIR=$d HFPAGED_WARMUP_THREADS=$threads timeout 100 python notes/results/session35/s35_warmup.py \
      2>&1 | grep -v Warning | tail -2 >> $OUT/warmup.log
    rm -rf $d
  done
done
cat $OUT/warmup.log; cat $OUT/nproc.txt
