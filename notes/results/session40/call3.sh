#!/bin/bash
# Session 40, call 3 (two GPUs, one suite half each): the GPU engine suites on the code with the nested-step change
# (the scheduler's preemption moved to core/preemption.py; EngineCore.step marks the requests of the step under way).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
git log -1 --format=%H > $OUT/commit.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
(CUDA_VISIBLE_DEVICES=0 timeout 540 $T tests/test_gpu_graphs.py tests/test_gpu_engine.py tests/test_gpu_training.py \
   tests/test_beam_search.py tests/test_parallel_sampling.py > $OUT/gpu0.log 2>&1; echo "rc $?" >> $OUT/gpu0.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 540 $T tests/test_gpu_reliability.py tests/test_async_scheduling.py \
   tests/test_gpu_differential.py tests/test_fp8_engine.py tests/test_model_changes.py > $OUT/gpu1.log 2>&1; \
   echo "rc $?" >> $OUT/gpu1.log) &
wait
for f in gpu0 gpu1; do echo "== $f"; grep -E "passed|failed|error|^FAILED|^ERROR|rc " $OUT/$f.log | tail -12; done
