"""PEFT models (LoRA and other tuners): the transformers model inside, and the adapter state that decides
what its forward computes. PEFT is optional: nothing here imports it unless the model is a PEFT model.

A ``PeftModel`` wraps a transformers model whose layers carry the adapters; hfpaged patches that inner
model (its attention is the model's own) and reaches it from the wrapper, which forwards attribute access
to it. Which adapters a layer applies (``set_adapter``, ``disable_adapter()``, ``merge_adapter``) is Python
state read in the forward: a change makes captured CUDA graphs and cached prefix KV stale.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def _peft_model_class() -> type | None:
    peft = sys.modules.get("peft")  # a PEFT model exists only if peft was imported
    return getattr(peft, "PeftModel", None)


def is_peft_model(model: Any) -> bool:
    cls = _peft_model_class()
    return cls is not None and isinstance(model, cls)


def inner_model(model: Any) -> Any:
    """The transformers model to patch: ``model`` itself, or the one a PEFT model wraps."""
    return model.get_base_model() if is_peft_model(model) else model


def check_peft_model(model: Any) -> None:
    """Refuse a PEFT model whose adapters are prompt learning (prompt tuning, P-tuning, prefix tuning): their virtual
    tokens are added by the ``PeftModel`` wrapper around the transformers model, which hfpaged does not run (PEFT
    keeps one kind of adapter per model, so the active one tells)."""
    if not is_peft_model(model):
        return
    kinds = sorted(
        {str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values() if c.is_prompt_learning}
    )
    if kinds:
        raise ValueError(
            f"hfpaged cannot patch a PEFT model with prompt-learning adapters ({', '.join(kinds)}): their virtual "
            "tokens come from the PeftModel wrapper, which generate_many would skip (other tokens than "
            "PeftModel.generate). Adapters inside the layers (LoRA, DoRA, IA3, LoHa, LoKr, VeRA, AdaLoRA) are supported"
        )


def adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose output depends on adapter settings (PEFT tuner layers); none for a plain model."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def adapter_state(layers: list[torch.nn.Module]) -> tuple:
    """What the adapter layers apply now: active adapters, disabled or not, merged adapters, and each adapter's
    scale (``set_scale``, ``rescale_adapter_scale``: the same weights, other outputs)."""
    return tuple(
        (
            tuple(layer.active_adapters),
            bool(layer.disable_adapters),
            tuple(layer.merged_adapters),
            tuple(sorted((name, _scale_key(value)) for name, value in getattr(layer, "scaling", {}).items())),
        )
        for layer in layers
    )


def _scale_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a tensor scale: its storage and in-place writes
        return (value.data_ptr(), value._version)
    return value
