"""The one configuration object of an hfpaged engine."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

ATTENTION_BACKENDS = ("auto", "triton", "torch")
PREEMPTION_MODES = ("recompute", "swap")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def is_real(value: object) -> bool:
    """A real number as ``generate`` and ``patch`` take one: Python's, numpy's, or a 0-d torch tensor or numpy array
    of one (not a bool, not complex)."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and value.dtype != torch.bool and not value.dtype.is_complex
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and (np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating))
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_finite_number(value: object) -> bool:
    """``is_real`` and finite."""
    return is_real(value) and math.isfinite(float(value))


@dataclass
class EngineConfig:
    """Settings fixed at ``patch`` time; validated on construction."""

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    attention_backend: str = "auto"  # "auto": Triton kernels on CUDA, torch reference elsewhere
    enforce_eager: bool = False  # True: never capture CUDA graphs
    async_scheduling: bool = True  # overlap the host's work for the next step with the device's current step
    compile: bool | None = None  # torch.compile the decoder layers of the steps captured in CUDA graphs (decode
    # and mixed; nothing is compiled where graphs are off); None: on for CUDA, a compile error falls back to eager
    # layers; True: on, errors raised; False: off
    compile_cache_dir: str | None = None  # compile: torch.compile artifacts on disk, keyed by model config,
    # dtype, device and versions; None: ~/.cache/hfpaged/compile; "": no hfpaged cache (torch's own stays)
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float | None = None  # GiB of pinned CPU memory for swapped-out blocks; None: as many blocks
    # as the GPU pool holds, at most 4 GiB (allocated at the first swap-out, not at patch time)
    watermark: float = 0.01  # share of blocks kept free when admitting new requests
    cpu_kv_cache_gib: float = 1.0  # KV budget when num_blocks=None on a non-CUDA device
    sleep_when_idle: bool = False  # release the pool (as hfpaged.sleep) whenever a call ends with nothing running
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (= "fp8_e4m3"), "fp8_e5m2": half the bytes
    kv_cache_scales: float | list[tuple[float, float]] | None = None  # fp8 only: one scale for every K and V, or
    # one (k_scale, v_scale) per attention layer; None: the checkpoint's k_scale/v_scale, else calibrated
    fuse_projections: bool | None = None  # q/k/v and gate/up as one GEMM each in paged steps (weights moved into
    # one buffer per group, no copy); None: on for layers on CUDA devices only; False: off (unfused, exact)
    dependent_launch: bool | None = None  # programmatic dependent launch inside steps (each Triton kernel, ours and
    # the compiled layers', starts while the kernel before it ends); None: on where supported (CUDA compute
    # capability 9.0+) except under tensor parallelism; True: required (an error where unsupported); False: off
    gemv: bool | None = None  # steps of one token (batch-1 decode) run their linear projections (the LM head too)
    # as a Triton GEMV that loads its weights before the dependent-launch wait (kernels/gemv.py; 16-bit weights;
    # not bitwise equal to cuBLAS); None: on where dependent launch is on; True: on (CUDA, or Triton's CPU
    # interpreter); False: off (cuBLAS, exact with fuse_projections=False)
    freeze_gc: bool = True  # after each CUDA graph capture, gc.freeze() what the warm-up left behind (~10^5-10^6
    # objects) so that Python's full collections skip it; undone when the engine drops its graphs (sleep, new
    # weights, unpatch). False: leave the garbage collector alone

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        positive_int("block_size")
        positive_int("max_num_seqs")
        positive_int("max_num_batched_tokens")
        if self.num_blocks is not None:
            positive_int("num_blocks")
        for name in ("gpu_memory_utilization", "swap_space", "watermark", "cpu_kv_cache_gib"):
            value = getattr(self, name)  # (checked before anything is built: a re-patch keeps the old patch)
            if not (value is None and name == "swap_space") and not is_finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_scales is not None:
            self._check_kv_cache_scales()
        for name in ("enforce_eager", "async_scheduling", "enable_prefix_caching", "sleep_when_idle", "freeze_gc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("compile", "fuse_projections", "dependent_launch", "gemv"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None, got {getattr(self, name)!r}")
        if self.compile_cache_dir is not None and not isinstance(self.compile_cache_dir, str):
            raise ValueError(f"compile_cache_dir must be a path, '' or None, got {self.compile_cache_dir!r}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")

    def _check_kv_cache_scales(self) -> None:
        if self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_scales apply to an fp8 KV cache; set kv_cache_dtype='fp8' (or 'fp8_e5m2')")
        scales = self.kv_cache_scales
        flat = [scales] if isinstance(scales, (int, float)) and not isinstance(scales, bool) else None
        pairs = isinstance(scales, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in scales)
        if pairs:
            flat = [value for pair in scales for value in pair]
        if not flat or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf") for v in flat
        ):
            raise ValueError(
                "kv_cache_scales must be a positive float or a list of (k_scale, v_scale) pairs of positive "
                f"floats, one per attention layer; got {scales!r}"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def out_of_memory_message(config: EngineConfig, scheduler_output: Any, error: BaseException) -> str:
    """What an out-of-memory error inside a step says: the step's size and the settings to lower."""
    step = ""
    if scheduler_output is not None:
        step = (
            f" in a step of {scheduler_output.num_batched_tokens} tokens for {len(scheduler_output.scheduled)} requests"
        )
    return (
        f"hfpaged ran out of device memory{step} ({error}). Every request was put back to be recomputed and "
        f"the KV pool is intact. Lower max_num_batched_tokens (now {config.max_num_batched_tokens}) or "
        f"max_num_seqs (now {config.max_num_seqs}), or gpu_memory_utilization (now "
        f"{config.gpu_memory_utilization}) to leave more room next to the pool, in hfpaged.patch(...)"
    )
