#!/bin/bash
# Session 36, call 1: the prompt launches' program order (KV heads innermost): the kernel against HEAD's copy and
# cuDNN (s36_a.py), the engine's long prefill and chat alternating old/new (s36_b.py), the GPU kernel suites.
# notes/results/session36/oldkernels is HEAD's kernels/ (untracked, shipped for this call only).
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
nvidia-smi --query-gpu=index,name --format=csv,noheader > $OUT/gpus.txt
timeout 150 python notes/results/session36/s36_a.py > $OUT/s36_a.log 2>&1; echo "rc $?" >> $OUT/s36_a.log
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_step_kv.py \
  tests/test_context_rows.py tests/test_leading_rows.py tests/test_attention_sinks.py tests/test_fp8_kernels.py \
  > $OUT/gpu_kernels.log 2>&1; echo "rc $?" >> $OUT/gpu_kernels.log
timeout 200 python notes/results/session36/s36_b.py > $OUT/s36_b.log 2>&1; echo "rc $?" >> $OUT/s36_b.log
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/s36_a.log"):
    if line.startswith("{"):
        r = json.loads(line)
        print(r.get("lens"), r.get("heads"), r.get("dim"), "eq", r.get("bitwise_equal"), "sdpa", r["sdpa"]["tflops"],
              "old", r["old"]["tflops"], r["old_pct_sdpa"], "new", r["new"]["tflops"], r["new_pct_sdpa"], "x", r["new_vs_old"])
    else:
        print(line.rstrip()[:300])
PY
tail -3 $OUT/gpu_kernels.log
cat $OUT/s36_b.log | cut -c1-400
