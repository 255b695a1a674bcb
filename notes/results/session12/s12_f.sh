export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; ln -sfn ../kernels hfpaged/kernels
T0=$(date +%s)
timeout 200 python .probe/s12_f.py > $OUT/s12_f.log 2>&1; echo "probe rc=$? t=$(( $(date +%s)-T0 ))"; grep "^auto\|^fp8\|Error" $OUT/s12_f.log | cut -c1-200
