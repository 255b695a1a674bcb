export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
T0=$(date +%s)
timeout 150 python .probe/s12_d.py qwen3-0.6b llama-3.2-1b > $OUT/s12_d.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-T0 ))"; grep "^qwen\|^llama\|Error" $OUT/s12_d.log | tail -12
timeout 420 python -m pytest -q -p no:cacheprovider -m gpu -k "not two_gpu" --durations=10 tests --ignore tests/test_serve.py --ignore tests/test_serve_multi.py > $OUT/gpu_suite.log 2>&1; echo "gpu suite rc=$? t=$(( $(date +%s)-T0 ))"; tail -3 $OUT/gpu_suite.log; grep "^FAILED\|^ERROR" $OUT/gpu_suite.log | head -20
