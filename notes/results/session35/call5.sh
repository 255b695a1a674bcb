#!/bin/bash
# Session 35, call 5 (two GPUs): the two-GPU tensor-parallel test with this session's checks (patch options compared
# across ranks, an empty call on one rank refused).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
timeout 400 python -m pytest -q -p no:cacheprovider -m gpu tests/test_tensor_parallel.py -k two_gpu > $OUT/tp.log 2>&1
echo "rc $?" >> $OUT/tp.log
tail -5 $OUT/tp.log; cat $OUT/gpus.txt
