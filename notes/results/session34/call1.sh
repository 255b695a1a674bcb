#!/bin/bash
# Session 34, call 1 (nvidia-h100-x1): issue 16's H100 figures with decode rows apart, then the GPU tests
# of the kernel changes made after session 33's last GPU call.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
mkdir -p $OUT/pool8 $OUT/full
timeout 280 python examples/bench_fp8_kv.py --model qwen3-0.6b --pool-gib 8 --workloads long nano --repeats 2 \
  --rows-together --out $OUT/pool8 > $OUT/pool8.log 2>&1; echo "rc $?" >> $OUT/pool8.log
timeout 120 python examples/bench_fp8_kv.py --model qwen3-0.6b --workloads nano_full --out $OUT/full \
  > $OUT/full.log 2>&1; echo "rc $?" >> $OUT/full.log
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_leading_rows.py > $OUT/leading.log 2>&1; echo "rc $?" >> $OUT/leading.log
timeout 100 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_step_kv.py > $OUT/kernels.log 2>&1
echo "rc $?" >> $OUT/kernels.log
for f in pool8 full leading kernels; do echo "== $f"; tail -6 $OUT/$f.log; done
