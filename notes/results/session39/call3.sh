#!/bin/bash
# Session 39, call 3: the Gluon fresh-prompt kernel in paged_attention: its GPU tests, probe B (on/off/cuDNN through
# the engine's call), the GPU kernel suites it touches.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_fresh_prompts.py -x > $OUT/gpu_fresh.log 2>&1; echo "rc $?" >> $OUT/gpu_fresh.log
tail -25 $OUT/gpu_fresh.log
timeout 200 python notes/results/session39/s39_b.py > $OUT/s39_b.log 2>&1; echo "rc $?" >> $OUT/s39_b.log
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/s39_b.log"):
    if line.startswith("{"):
        r = json.loads(line)
        print(r["heads"], r["kv_heads"], r["lens"] if len(r["lens"]) < 5 else f'{len(r["lens"])}x{r["lens"][0]}',
              r["context"] if any(r["context"]) else "", "ran", r["gluon_ran"], "eq", r["bitwise_equal"],
              round(r["max_diff_on_off"], 5), "err", r.get("err_on"), r.get("err_off"), "| on", r["on"]["tflops"],
              "off", r["off"]["tflops"], "sdpa", r.get("sdpa", {}).get("tflops"), "x", r["on_vs_off"],
              "%cudnn", r.get("on_pct_sdpa"), r.get("off_pct_sdpa"))
    else:
        print(line.rstrip()[:600])
PY
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_step_kv.py \
  tests/test_context_rows.py tests/test_leading_rows.py > $OUT/gpu_kernels.log 2>&1; echo "rc $?" >> $OUT/gpu_kernels.log
tail -5 $OUT/gpu_kernels.log
