"""FP8 KV cache: the cache dtype ``kv_cache_dtype`` names, the device check, and the per-layer K/V scales.

A layer's fp8 cache holds ``x / scale`` (saturated to the format's finite range) with one float32 scale for
its K and one for its V, in a ``[2]`` device tensor the kernels read at run time (so CUDA graphs captured
before the scales are known still read the right ones). Scales come, in this order, from the user
(``kv_cache_scales``), from the checkpoint (``k_scale``/``v_scale`` tensors on the attention module, as
compressed-tensors attaches them; used as is), or from calibration: the first eager forward that stores
K/V sets each layer's scales to ``CALIBRATION_MARGIN x amax / fp8_max`` of that forward's keys and values,
before storing them. Later values beyond the calibrated range saturate.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import torch

from ..kernels._checks import FP8_DTYPES, FP8_MAX

if TYPE_CHECKING:
    from ..core.config import EngineConfig
    from .attention import LayerRecord

logger = logging.getLogger("hfpaged")

FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# amax of the calibration forward maps to fp8_max / CALIBRATION_MARGIN: room for later keys and values up to
# twice as large before they saturate, for one binade less at the bottom of the range (see notes/fp8_kv.md)
CALIBRATION_MARGIN = 2.0


def cache_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The torch dtype of an fp8 cache, or None for ``"auto"`` (the model's dtype)."""
    return FP8_CACHE_DTYPES.get(kv_cache_dtype)


def check_fp8_device(device: torch.device, dtype: torch.dtype, setting: str) -> None:
    """Raise ValueError unless ``device`` can hold and convert ``dtype`` (CUDA: compute capability 8.9+)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={setting!r} needs a GPU with fp8 support (compute capability 8.9 or newer: "
                f"Ada, Hopper, Blackwell); {device} ({torch.cuda.get_device_name(device)}) has "
                f"{capability[0]}.{capability[1]}. Use kv_cache_dtype='auto'."
            )
        return
    try:
        torch.ones(2, device=device).to(dtype).float().sum().item()
    except Exception as exc:  # e.g. a backend without float8 kernels
        raise ValueError(
            f"kv_cache_dtype={setting!r}: {device} does not support {dtype} tensors ({exc}); use kv_cache_dtype='auto'"
        ) from exc


def _checkpoint_scales(module: torch.nn.Module) -> tuple[float, float] | None:
    k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
    if not (isinstance(k_scale, torch.Tensor) and isinstance(v_scale, torch.Tensor)):
        return None
    # per-tensor scales as compressed-tensors stores them; several (per head) collapse to the largest
    return float(k_scale.detach().float().max()), float(v_scale.detach().float().max())


def given_scales(layers: list[LayerRecord], config: EngineConfig) -> list[tuple[float, float]] | None:
    """The user's ``kv_cache_scales`` as one (k_scale, v_scale) pair per layer (None: not given); ValueError for a
    count that does not match the layers (``patch`` checks it before taking an existing patch off)."""
    given = config.kv_cache_scales
    if given is None:
        return None
    pairs = [(float(given), float(given))] * len(layers) if isinstance(given, (int, float)) else list(given)
    if len(pairs) != len(layers):
        raise ValueError(
            f"kv_cache_scales has {len(pairs)} (k_scale, v_scale) pairs but the model has {len(layers)} "
            "attention layers; give one pair per layer, or one float for all"
        )
    return pairs


def initial_scales(layers: list[LayerRecord], config: EngineConfig) -> tuple[list[torch.Tensor], str]:
    """One float32 ``[2]`` (k_scale, v_scale) tensor per layer on its device, and where they came from:
    ``"user"``, ``"checkpoint"`` or ``"calibration"`` (ones until the first forward that stores K/V)."""
    pairs = given_scales(layers, config)
    if pairs is not None:
        source = "user"
    else:
        found = [_checkpoint_scales(layer.module) for layer in layers]
        if all(pair is not None for pair in found):
            pairs, source = found, "checkpoint"
        else:
            pairs, source = [(1.0, 1.0)] * len(layers), "calibration"
    scales = [torch.tensor(pair, dtype=torch.float32, device=layer.device) for pair, layer in zip(pairs, layers)]
    return scales, source


# a calibrating step of fewer tokens warns: its largest |K| and |V| say little about later prompts' (they saturate)
MIN_CALIBRATION_TOKENS = 64


def calibration_step(pending: bool, num_tokens: int) -> bool:
    """Whether this eager step calibrates (``pending``); warns when it stores too few tokens to calibrate on."""
    if pending and num_tokens < MIN_CALIBRATION_TOKENS:
        warnings.warn(
            f"fp8 KV scales are being calibrated on a step of {num_tokens} tokens (the first step that stores K/V: "
            "the first prompt, or its first chunk): later keys and values above twice its largest saturate. Make "
            "the first call a representative prompt of at least 64 tokens, or pass kv_cache_scales to patch()",
            stacklevel=3,
        )
    return pending


def calibrate(scales: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Set a layer's ``[2]`` scales from this forward's keys and values, in place, on the device (no sync)."""
    amax = torch.stack([key.detach().abs().amax(), value.detach().abs().amax()]).float()
    scales.copy_(torch.where(amax > 0, amax * (CALIBRATION_MARGIN / FP8_MAX[dtype]), 1.0))


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache tensor for moving whole blocks: fp8 viewed as uint8 (index_copy_ has no fp8 kernel on the CPU)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache
