#!/bin/bash
# Session 39, call 6: the fresh-prompt GPU tests after the review's changes (81d5096: 150 sequences, an empty one,
# fp16 poison) and the engine under chunking, prefix hits and preemption with the Gluon kernel on/off.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
timeout 500 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py > $OUT/gpu_fresh.log 2>&1; echo "rc $?" >> $OUT/gpu_fresh.log
grep -E "passed|failed|Error|assert" $OUT/gpu_fresh.log | tail -15
