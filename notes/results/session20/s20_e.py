"""Probe E (session 20): batch-1 decode ms/token by the split count's cap (attention_config.MAX_SPLITS: 64, the
default, gives 33 splits per KV head at batch 1 on an H100; 17; 9).

python notes/results/session20/s20_e.py MODEL[,MODEL...] REPS CAP[,CAP...] [--dry-run]
Probe B (s20_b.py) with the cap as its setting: per model and repeat, each cap in turn (a fresh patch each),
benchmark.batch1_latency at a 128-token prompt (256 new) and at a 2,000-token prompt (128 new).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import s20_b  # noqa: E402

if __name__ == "__main__":
    s20_b.main(setting="MAX_SPLITS", label="max_splits")
