"""Shared by the session-21 probes: the model a probe measures (a tiny float16 Llama for --dry-run on the CPU)."""

import sys

import torch

sys.path.insert(0, "examples")
import benchmark  # noqa: E402


def probe_model(name: str, dry: bool):
    """``benchmark.build_model(name)`` in bf16, or with ``dry`` a tiny random float16 Llama (and CUDA syncs off)."""
    if not dry:
        return benchmark.build_model(name, torch.bfloat16)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.cuda.synchronize = lambda *a, **k: None
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).half().eval()
