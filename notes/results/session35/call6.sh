#!/bin/bash
# Session 35, call 6 (nvidia-h100-x1): where a warm start's 10.9 s go (call 2: target 10 s). One cold-start child
# fills fresh caches, a second runs with them under cProfile; the profile's top entries by cumulative and own time.
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
ln -sfn ../kernels hfpaged/kernels
c=$(mktemp -d)
export TRITON_CACHE_DIR=$c/triton TORCHINDUCTOR_CACHE_DIR=$c/inductor PYTHONPYCACHEPREFIX=$c/pyc
unset PYTHONDONTWRITEBYTECODE
child="examples/benchmark.py --cold-start-child qwen3-0.6b --compile-cache-dir $c/hfpaged"
timeout 150 python $child > $OUT/cold.log 2>&1; echo "rc $?" >> $OUT/cold.log
timeout 120 python $child > $OUT/warm_plain.log 2>&1; echo "rc $?" >> $OUT/warm_plain.log
timeout 150 python -m cProfile -o $OUT/warm.prof $child > $OUT/warm.log 2>&1; echo "rc $?" >> $OUT/warm.log
python - "$OUT/warm.prof" > $OUT/warm_top.txt <<'PY'
import pstats, sys
p = pstats.Stats(sys.argv[1])
p.sort_stats("cumulative").print_stats(70)
p.sort_stats("tottime").print_stats(40)
PY
grep COLD_START $OUT/cold.log $OUT/warm_plain.log $OUT/warm.log | cut -c1-400
