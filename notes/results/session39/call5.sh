#!/bin/bash
# Session 39, call 5: every fresh-prompt GPU test (the engine's tokens with the Gluon kernel on/off, eager and
# graphs), then the graph suite as a regression check of the Triton kernel's new SKIP_FRESH variant beside it.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
timeout 280 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py > $OUT/gpu_fresh.log 2>&1; echo "rc $?" >> $OUT/gpu_fresh.log
tail -6 $OUT/gpu_fresh.log
timeout 280 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_graphs.py > $OUT/gpu_graphs.log 2>&1; echo "rc $?" >> $OUT/gpu_graphs.log
tail -4 $OUT/gpu_graphs.log
