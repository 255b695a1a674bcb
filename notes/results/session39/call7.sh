#!/bin/bash
# Session 39, call 7: the engine under chunking, prefix hits and preemption with the Gluon kernel on/off (240 blocks).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
timeout 250 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py -k under_chunking > $OUT/gpu_pressure.log 2>&1; echo "rc $?" >> $OUT/gpu_pressure.log
grep -E "passed|failed|Error|assert" $OUT/gpu_pressure.log | tail -8
