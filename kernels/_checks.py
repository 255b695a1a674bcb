"""Argument checks shared by the kernel wrappers: each failure names the argument and the numbers."""

from __future__ import annotations

import functools
import inspect
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensor(name: str, tensor: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Raise TypeError/ValueError unless ``tensor`` is a torch tensor of ``ndim`` dims and one of ``dtypes``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(tensor.dtype).replace('torch.', '')}")
    return tensor


def check_devices(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and a CUDA one unless Triton is interpreting; returns that device."""
    names = list(tensors)
    device = tensors[names[0]].device
    for name in names[1:]:
        if tensors[name].device != device:
            raise ValueError(
                f"{name} is on {tensors[name].device} but {names[0]} is on {device}: all tensors must share one device"
            )
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got {device}; on CPU use the torch reference "
            "(hfpaged.kernels.paged_attention_reference / store_kv_reference) or set TRITON_INTERPRET=1"
        )
    return device


def check_dim(name: str, tensor: torch.Tensor, dim: int, expected: int, why: str) -> None:
    """Raise ValueError unless ``tensor.shape[dim] == expected``."""
    if tensor.shape[dim] != expected:
        raise ValueError(
            f"{name}.shape[{dim}] must be {expected} ({why}), got {tensor.shape[dim]} (shape {tuple(tensor.shape)})"
        )


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def launches_on_first_tensor_gpu(fn):
    """Run a kernel wrapper with its first tensor's GPU current (Triton launches on the current device's
    stream); nothing changes unless that tensor lives on another GPU (models spread over several GPUs)."""

    first_name = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = args[0] if args else kwargs[first_name]
        if first.is_cuda and first.device.index is not None and first.device.index != torch.cuda.current_device():
            with torch.cuda.device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
