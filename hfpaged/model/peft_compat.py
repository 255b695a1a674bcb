"""PEFT models (LoRA and other tuners): the transformers model inside, and the adapter state that decides
what its forward computes. PEFT is optional: nothing here imports it unless the model is a PEFT model.

A ``PeftModel`` wraps a transformers model whose layers carry the adapters; hfpaged patches that inner
model (its attention is the model's own) and reaches it from the wrapper, which forwards attribute access
to it. Which adapters a layer applies (``set_adapter``, ``disable_adapter()``, ``merge_adapter``) is Python
state read in the forward: a change makes captured CUDA graphs and cached prefix KV stale.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
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
    keeps one kind of adapter per model, so the active one tells); or whose active adapter is an aLoRA
    (``check_alora``)."""
    if not is_peft_model(model):
        return
    check_alora(adapter_layers(inner_model(model)))
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
    """The modules whose output depends on adapter settings (PEFT tuner layers, and the wrappers of
    ``modules_to_save`` / trainable tokens, which toggle their adapter copies the same way); none for a plain model."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    kinds: tuple[type, ...] = (BaseTunerLayer,)
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper

        kinds += (AuxiliaryTrainingWrapper,)
    except ImportError:  # older peft: ModulesToSaveWrapper alone
        with contextlib.suppress(ImportError):
            from peft.utils.other import ModulesToSaveWrapper

            kinds += (ModulesToSaveWrapper,)
    return [module for module in model.modules() if isinstance(module, kinds)]


# refusals per adapter-layer list (keyed by its first layer), part of ``adapter_state``: the call a refusal interrupts
# leaves the model's fingerprint half read, so the next call that passes counts as changed adapters (drops all)
_REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_alora(layers: list[torch.nn.Module]) -> None:
    """Refuse active aLoRA adapters (activated LoRA, ``LoraConfig(alora_invocation_tokens=...)``): where in each
    sequence they apply (``alora_offsets``, after the invocation tokens) is computed by ``PeftModel.forward`` and
    ``generate`` in the wrapper, which hfpaged does not run; without it the layers apply nothing (the base model's
    tokens). Read from the layers, so an aLoRA loaded or activated after ``patch`` is refused at the next call."""
    names = sorted(
        {
            name
            for layer in layers
            if getattr(layer, "lora_variant", None) and not layer.disable_adapters
            for name in layer.active_adapters
            if type(layer.lora_variant.get(name)).__name__ == "ALoraLinearVariant"
        }
    )
    if names:
        _REFUSALS[layers[0]] = _REFUSALS.get(layers[0], 0) + 1
        raise ValueError(
            f"hfpaged cannot run a PEFT model whose active adapter is an aLoRA ({', '.join(map(repr, names))}: "
            "LoraConfig(alora_invocation_tokens=...)): where it applies (alora_offsets, after the invocation tokens) "
            "is computed by the PeftModel wrapper, which generate_many would skip, serving the base model's tokens "
            "(other tokens than PeftModel.generate). Activate another adapter (set_adapter) or use PeftModel.generate"
        )


def adapter_state(layers: list[torch.nn.Module]) -> tuple:
    """What the adapter layers apply now: active adapters, disabled or not, merged adapters, and each adapter's
    scale (``set_scale``, ``rescale_adapter_scale``: the same weights, other outputs). An active aLoRA adapter
    raises (``check_alora``): this runs at every call."""
    check_alora(layers)
    return tuple(
        (
            tuple(layer.active_adapters),
            bool(layer.disable_adapters),
            tuple(layer.merged_adapters),
            tuple(sorted((name, _scale_key(value)) for name, value in getattr(layer, "scaling", {}).items())),
        )
        for layer in layers
    ) + ((_REFUSALS.get(layers[0], 0),) if layers else ())


def _scale_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # a tensor scale: its storage and in-place writes
        return (value.data_ptr(), value._version)
    return value
