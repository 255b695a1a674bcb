export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
T0=$(date +%s)
timeout 300 python .probe/s12_c.py qwen3-0.6b llama-3.2-1b > $OUT/s12_c.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-T0 ))"; grep -v "^argmax\|Warn\|warn" $OUT/s12_c.log | tail -12
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_argmax_kernel.py tests/test_sampling_fidelity.py tests/test_gpu_graphs.py > $OUT/argmax_gpu_tests.log 2>&1; echo "tests rc=$? t=$(( $(date +%s)-T0 ))"; tail -3 $OUT/argmax_gpu_tests.log
