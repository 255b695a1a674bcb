"""Probe C (session 23): session 22's chat profile (probe B: kernels grouped per CUDA-graph step, marginal time per
kernel kind) once per prompt-tile setting of probe B of this session ("old", "tile", "new"), so the device time of
the mixed steps can be compared without the host's run-to-run noise.

python notes/results/session23/s23_c.py MODEL OUT_DIR SETTING[,SETTING...] [--dry-run]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "session22"))
sys.path.insert(0, HERE)
import s22_b  # noqa: E402
import s23_b  # noqa: E402


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name, out_dir, settings = args[0], args[1], args[2].split(",")
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    for setting in settings:
        tile, hint = s23_b.SETTINGS[setting]
        s23_b.attention_config.prompt_tile, s23_b.runner_module.short_prompt_hint = tile, hint
        print(f"== {setting}", flush=True)
        sys.argv = ["s22_b.py", name, os.path.join(out_dir, setting), *flags]
        s22_b.main()
    s23_b.attention_config.prompt_tile, s23_b.runner_module.short_prompt_hint = s23_b.NEW_TILE, s23_b.HINT


if __name__ == "__main__":
    main()
