#!/bin/bash
# Session 33's GPU call on a 4-GPU machine: the GPU suites and the fp8 benchmark side by side, one GPU each.
# Usage (repo root, $OUT set): bash notes/results/session33/gpu_final.sh
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
T="timeout 560 python -m pytest -q -p no:cacheprovider -m gpu"
A1="tests/test_gpu_graphs.py tests/test_gpu_reliability.py tests/test_gpu_engine.py tests/test_gpu_gemv.py tests/test_gpu_training.py"
A2="tests/test_fp8_engine.py tests/test_async_scheduling.py tests/test_fused_store.py tests/test_argmax_kernel.py tests/test_fp8_decode_cuda.py tests/test_fp8_kernels.py"
(CUDA_VISIBLE_DEVICES=0 $T $A1 > $OUT/suiteA1.log 2>&1; echo "rc $?" >> $OUT/suiteA1.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 120 python -m pytest -q -p no:cacheprovider tests/test_leading_rows.py > $OUT/leading.log 2>&1
 echo "rc $?" >> $OUT/leading.log
 CUDA_VISIBLE_DEVICES=1 $T $A2 > $OUT/suiteA2.log 2>&1; echo "rc $?" >> $OUT/suiteA2.log) &
(CUDA_VISIBLE_DEVICES=2 $T tests/test_gpu_differential.py > $OUT/differential.log 2>&1; echo "rc $?" >> $OUT/differential.log
 CUDA_VISIBLE_DEVICES=2 timeout 250 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_step_kv.py \
   > $OUT/kernels.log 2>&1; echo "rc $?" >> $OUT/kernels.log) &
(
  mkdir -p $OUT/bench
  CUDA_VISIBLE_DEVICES=3 timeout 240 python examples/bench_fp8_kv.py --model qwen3-0.6b --pool-gib 8 \
    --workloads long nano --repeats 2 --rows-together --out $OUT/bench > $OUT/bench.log 2>&1
  echo "rc $?" >> $OUT/bench.log
  CUDA_VISIBLE_DEVICES=3 timeout 320 python -m pytest -q -p no:cacheprovider tests/test_architectures.py \
    > $OUT/architectures.log 2>&1
  echo "rc $?" >> $OUT/architectures.log
) &
wait
for f in suiteA1 leading suiteA2 differential kernels bench architectures; do echo "== $f"; tail -4 $OUT/$f.log; done
