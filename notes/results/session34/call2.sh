#!/bin/bash
# Session 34, call 2 (two GPUs, one suite each): the warm-up's graph-hint variants (new tests; the engine test also
# on the code before the change, from .s34/old), the GPU suites of everything changed since session 33's call 4,
# and the architecture cases that call 4's timeout cut.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
T="python -m pytest -q -p no:cacheprovider -m gpu"
A1="tests/test_gpu_graphs.py tests/test_gpu_reliability.py tests/test_gpu_engine.py tests/test_gpu_gemv.py tests/test_gpu_training.py"
A2="tests/test_fp8_engine.py tests/test_async_scheduling.py tests/test_fused_store.py tests/test_argmax_kernel.py tests/test_fp8_decode_cuda.py tests/test_fp8_kernels.py"
ARCH="seed_oss or ernie4_5 or helium or gpt_oss or granite_swa or granitemoe_swa or mimo_v2_flash or flint or mla_heads_replay"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 150 $T -s tests/test_kernels.py tests/test_fp8_engine.py -k "warm_up_compiles or long_context" > $OUT/new_tests.log 2>&1
  echo "rc $?" >> $OUT/new_tests.log
  (cd .s34/old && ln -sfn ../kernels hfpaged/kernels && python -c "import hfpaged; print(hfpaged.__file__)" \
    && PYTHONPATH=$PWD timeout 120 $T tests/test_fp8_engine.py -k long_context) > $OUT/old_code.log 2>&1
  echo "rc $?" >> $OUT/old_code.log
  timeout 300 $T $A2 > $OUT/suiteA2.log 2>&1; echo "rc $?" >> $OUT/suiteA2.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 400 $T $A1 > $OUT/suiteA1.log 2>&1; echo "rc $?" >> $OUT/suiteA1.log
  timeout 175 $T tests/test_architectures.py -k "$ARCH" > $OUT/architectures.log 2>&1; echo "rc $?" >> $OUT/architectures.log
) &
wait
for f in new_tests old_code suiteA2 suiteA1 architectures; do echo "== $f"; tail -5 $OUT/$f.log; done
