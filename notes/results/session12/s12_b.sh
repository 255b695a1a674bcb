export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
T0=$(date +%s)
timeout 560 python .probe/s12_b.py qwen3-0.6b llama-3.2-1b llama-3.1-8b > $OUT/s12_b.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-T0 ))"; grep -v Warning $OUT/s12_b.log | grep "^qwen\|^llama\|Error" | tail -20
