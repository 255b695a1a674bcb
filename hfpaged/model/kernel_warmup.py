"""A runner's Triton kernel warm-up: the variants a run will meet, compiled up front (``kernels/warmup.py``).

Their compiles run in worker processes (``kernels/compile_ahead.py``). With compiled layers the workers run on beside
the first layer compile, whose dynamo trace and Inductor compile launch none of our kernels: the first in-process
compile of one of them (Triton's hook, any thread) joins the workers, and ``finish`` (after the first compiled
forward, before any capture or eager forward) joins them too and runs the warm-up's own launches, every compile a
cache hit. Eager layers launch our kernels at once, so there the warm-up finishes before the first forward.
"""

from __future__ import annotations

import time

import torch

from .input_batch import padded_width


class KernelWarmup:
    """``start(overlap)`` once (the runner's first step), ``finish()`` where the kernels must be ready."""

    def __init__(self, state, device: torch.device):
        self.state = state  # the runner's weak proxy: the state owns the runner that owns this (no cycle)
        self.device = device
        self.started = False
        self.seconds = 0.0  # wall time in start and finish (CUDA; cold start diagnostics)
        self.stats: dict = {}  # its compiles in worker processes: counts (kernels/compile_ahead.py)
        self._ahead = None  # those workers while they run
        self._launches_left = False  # the warm-up's own launches, still to run

    @torch.inference_mode()
    def start(self, overlap: bool) -> None:
        """Record the variants and start their workers; without ``overlap`` (or workers) finish at once."""
        self.started = True
        if not self.state.use_triton or self.device.type != "cuda":
            return
        from ..kernels.compile_ahead import start_compile_ahead

        start = time.perf_counter()
        self._ahead = start_compile_ahead(self._launch_all, self.device, pin_cache_dir=overlap)
        self._launches_left = True
        self.stats = self._ahead.stats
        self.seconds = time.perf_counter() - start
        if not overlap or not self._ahead.running:
            self.finish()

    @torch.inference_mode()
    def finish(self, launch: bool = True) -> None:
        """Join the workers (if still running); then (``launch``) run the warm-up's launches here, once."""
        if self._ahead is None and not (launch and self._launches_left):
            return
        start = time.perf_counter()
        if self._ahead is not None:
            self._ahead.join()  # (or the first compile of one of our kernels here joined them already)
            self._ahead = None
        if launch and self._launches_left:
            self._launches_left = False
            self._launch_all()
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start

    def _launch_all(self) -> None:
        from ..kernels.warmup import warm_up_layers

        state, config = self.state, self.state.config
        warm_up_layers(state.layers, state.kv_caches, state.kv_scales or [None] * len(state.layers),
                       max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                       column_multiple=padded_width(1), launch_pdl=state.dependent_launch)  # fmt: skip
        state.fused_projections.warm_up_gemv()
