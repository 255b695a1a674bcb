export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
T0=$(date +%s)
B="--heads 16/8 --batches 1,2,8,64 --contexts 512,1024,4096 --skip prefill,store"
cp kernels/attention_kernel.py /tmp/new_kernel.py
timeout 90 python examples/bench_kernels.py $B --out $OUT/lookup_new.json > /dev/null 2>&1; echo "new rc=$? t=$(( $(date +%s)-T0 ))"
cp .probe/attention_kernel_old.py kernels/attention_kernel.py
timeout 90 python examples/bench_kernels.py $B --out $OUT/lookup_old.json > /dev/null 2>&1; echo "old rc=$? t=$(( $(date +%s)-T0 ))"
cp /tmp/new_kernel.py kernels/attention_kernel.py
timeout 280 python .probe/s12_a.py qwen3-0.6b > $OUT/s12_a.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-T0 ))"; grep -v "^argmax" $OUT/s12_a.log | tail -8
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_fp8_kernels.py tests/test_gpu_graphs.py > $OUT/lookup_gpu_tests.log 2>&1; echo "tests rc=$? t=$(( $(date +%s)-T0 ))"; tail -1 $OUT/lookup_gpu_tests.log
