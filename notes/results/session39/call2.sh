#!/bin/bash
# Session 39, call 2: the warp-specialized Gluon forward (producer warp group, two consumer groups, ping-pong or not)
# against cuDNN, our kernel and its other tiles (s39_a.py).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
WS=1
CHECK=1 timeout 90 python notes/results/session39/s39_a.py > $OUT/ws_check.log 2>&1; rc=$?; echo "rc $rc" >> $OUT/ws_check.log
cat $OUT/ws_check.log | tail -8
if [ $rc -ne 0 ]; then WS=0; fi
WS=$WS timeout 420 python notes/results/session39/s39_a.py > $OUT/s39_a.log 2>&1; echo "rc $?" >> $OUT/s39_a.log
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/s39_a.log"):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["heads"], r["kv_heads"], r["dim"], r["n"])
        for k, v in r.items():
            if isinstance(v, dict):
                print("   ", k, {a: b for a, b in v.items() if a != "us"})
    else:
        print(line.rstrip()[:600])
PY
