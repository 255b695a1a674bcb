"""Argument checks shared by the kernel wrappers: each failure names the argument and the numbers."""

from __future__ import annotations

import functools
import inspect
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
SINK_DTYPES = (*FLOAT_DTYPES, torch.float64)  # attention sinks (16/32-bit read as they are, float64 as a copy)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}  # largest finite value of each format
MAX_HEAD_DIM = 256  # the widest query/key or value head paged_attention takes


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


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy when its last dimension is strided: the kernels read index tensors (lengths,
    offsets, slots, block-table rows) element by element with stride 1."""
    return tensor if tensor.shape[-1] <= 1 or tensor.stride(-1) == 1 else tensor.contiguous()


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


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: object, v_scale: object) -> bool:
    """Whether the caches hold fp8 (then ``k_scale``/``v_scale`` must be one-element float32 tensors on their
    device); raise TypeError/ValueError for mismatched cache dtypes or missing/bad scales."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}; they must match")
    if k_cache.dtype not in FP8_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply to fp8 caches only; the caches are {k_cache.dtype}")
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(
                f"{name} must be a one-element float32 tensor for an fp8 ({k_cache.dtype}) cache, got "
                + (f"{scale.dtype} of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else repr(scale))
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{name} is on {scale.device} but the caches are on {k_cache.device}")
    return True


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


def check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, k_scale, v_scale, sinks) -> None:
    """The arguments of ``paged_attention``: dtypes, devices and shapes that agree (raises TypeError/ValueError)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    check_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,))
    check_devices(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )
    if sinks is not None:  # attention sinks: one logit per query head
        check_tensor("sinks", sinks, 1, SINK_DTYPES)
        check_devices(q=q, sinks=sinks)
        check_dim("sinks", sinks, 0, q.shape[1], "q.shape[1], num_heads")
    if not fp8 and k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache dtype {k_cache.dtype} differs from q dtype {q.dtype}; they must match (or be fp8)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    check_dim("k_cache", k_cache, 3, head_dim, "q.shape[2], head_dim")
    check_dim("v_cache", v_cache, 0, k_cache.shape[0], "k_cache.shape[0], num_blocks")
    check_dim("v_cache", v_cache, 1, k_cache.shape[1], "k_cache.shape[1], block_size")
    check_dim("v_cache", v_cache, 2, num_kv_heads, "k_cache.shape[2], num_kv_heads")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads (q.shape[1] = {num_heads}) must be a multiple of num_kv_heads (k_cache.shape[2] = {num_kv_heads})"
        )
    if head_dim > MAX_HEAD_DIM or v_cache.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got q {head_dim} and v_cache {v_cache.shape[3]}")
    num_seqs = seq_lens.shape[0]
    check_dim("block_tables", block_tables, 0, num_seqs, "seq_lens.shape[0], the number of sequences")
    check_dim("cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "seq_lens.shape[0] + 1")
