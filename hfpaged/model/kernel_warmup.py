"""A runner's Triton kernel warm-up (``kernels/warmup.py``), run in a background thread beside the first compile.

The first step of a process compiles the Triton kernel variants a run will meet (seconds to tens of seconds with
empty caches) and then, inside the first CUDA graph capture's warm-up, the decoder layers with torch.compile. Both
are compiles with parts that run without the GIL (``ptxas`` and Inductor's compile workers in subprocesses), so the
runner starts the kernel warm-up in a thread and lets the layer compile proceed; it joins the thread before the
first graph is captured (a capture must find every variant compiled) or before an eager forward. The warm-up
writes nothing (every slot is -1): the compile's own forward may run beside it. ``HFPAGED_WARMUP_OVERLAP=0`` runs it
in the caller's thread instead, at start.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from .input_batch import padded_width

if TYPE_CHECKING:
    from collections.abc import Callable

    from .attach import PatchState


def _overlap_from_env() -> bool:
    value = os.environ.get("HFPAGED_WARMUP_OVERLAP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"HFPAGED_WARMUP_OVERLAP must be 0 or 1, got {value!r}")
    return value == "1"


OVERLAP = _overlap_from_env()


def warm_up_kernels(state: PatchState, device: torch.device) -> None:
    """Compile (and run once, storing nothing) each Triton variant the patched model's layers will launch."""
    from ..kernels.warmup import warm_up

    config = state.config
    seen = set()
    scales = state.kv_scales or [None] * len(state.layers)
    for layer, (k_cache, v_cache), layer_scales in zip(state.layers, state.kv_caches, scales):
        key = (
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.head_dim_v,
            layer.dtype,
            layer.sliding_window,
            layer.softcap,
        )
        if key in seen:
            continue
        seen.add(key)
        warm_up(
            k_cache,
            v_cache,
            num_heads=layer.num_heads,
            sliding_window=layer.sliding_window,
            softcap=layer.softcap,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            column_multiple=padded_width(1),
            dtype=layer.dtype,
            kv_scales=None if layer_scales is None else (layer_scales[0:1], layer_scales[1:2]),
            launch_pdl=state.dependent_launch,
        )
    state.fused_projections.warm_up_gemv()
    torch.cuda.synchronize(device)


class BackgroundWarmup:
    """``body()`` once, in a thread from ``start()`` (on ``device``, in inference mode) until ``finish()`` joins it
    and raises what it raised; ``seconds``: its wall time. Without overlap, ``start()`` runs it there and then."""

    def __init__(self, body: Callable[[], None], device: torch.device, overlap: bool | None = None):
        self._body = body
        self._device = device
        self._overlap = OVERLAP if overlap is None else overlap
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.raised: BaseException | None = None  # the error finish() raised, so callers can tell it from theirs
        self.started = False
        self.seconds = 0.0

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        if not self._overlap:
            self._run()
            self._raise()
            return
        self._thread = threading.Thread(target=self._run, name="hfpaged-kernel-warmup", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Wait for the warm-up (a no-op once it is done, or if it never started); its error, once."""
        self.wait()
        self._raise()

    def wait(self) -> None:
        """Wait for the warm-up without raising its error (``finish`` still will)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            on_device = torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()
            with on_device, torch.inference_mode():
                self._body()
        except BaseException as error:  # re-raised in the caller's thread by finish()
            self._error = error
        finally:
            self.seconds = time.perf_counter() - start

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            self.raised = error
            raise error
