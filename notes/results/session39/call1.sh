#!/bin/bash
# Session 39, call 1: prompt attention, Gluon FA3-style overlap vs our kernel (tiles) vs cuDNN (s39_a.py).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name,clocks.max.sm --format=csv,noheader > $OUT/gpus.txt
timeout 400 python notes/results/session39/s39_a.py > $OUT/s39_a.log 2>&1; echo "rc $?" >> $OUT/s39_a.log
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/s39_a.log"):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["heads"], r["kv_heads"], r["dim"], r["n"])
        for k, v in r.items():
            if isinstance(v, dict):
                print("   ", k, v)
    else:
        print(line.rstrip()[:600])
PY
