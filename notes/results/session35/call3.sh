#!/bin/bash
# Session 35, call 3 (nvidia-h100-x1): where a decode step's host time goes on the GPU machine (Llama-3.2-1B chat,
# s35_phases.py), then the GPU reliability and async suites on this session's interrupt and scheduler changes.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
timeout 200 python notes/results/session35/s35_phases.py llama-3.2-1b 4 > $OUT/phases.log 2>&1; echo "rc $?" >> $OUT/phases.log
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_reliability.py tests/test_async_scheduling.py \
  > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
cat $OUT/phases.log | tr -s ' ' | cut -c1-3000
tail -3 $OUT/gpu_tests.log
