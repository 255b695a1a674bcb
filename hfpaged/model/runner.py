"""The device side of a step: ``ModelRunner.execute(scheduler_output) -> StepResult``.

It updates the persistent batch from the scheduler's diffs, performs the block copies (swap, copy-on-write),
packs the step (its inputs cross to the device in ONE copy), runs one packed forward of the unmodified model
with paged attention - on CUDA a captured CUDA graph (decode steps by batch bucket, steps with prefill tokens by
token bucket; compiled decoder layers inside unless ``compile=False``), the eager forward otherwise - and samples (processors, forked samples, beam rows included). Nothing in it waits for the device: the
``StepResult`` holds the tokens on the device at once (the next step reads a pending token there) and on the
host once its copy has landed.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.block_pool import cdiv
from ..core.scheduler_output import SchedulerOutput
from ..sampling.sampler import Sampler, StepResult, all_plain_greedy
from .attention import PagedStep, eval_mode, no_autocast, paged_forward
from .cuda_graphs import StepGraphs, short_prompt_hint
from .fused_projections import fused_step
from .gc_heap import HeapFreeze
from .input_batch import DeviceStep, HostStep, InputBatch, device_views, padded_width, region_slices
from .kernel_warmup import KernelWarmup
from .kv_quant import as_bytes, calibration_step
from .long_rope import long_rope_step
from .tp_local import local_step
from .weights_version import global_module_hooks

if TYPE_CHECKING:
    from .attach import PatchState

logger = logging.getLogger("hfpaged")


class ModelRunner:
    """Persistent batch, packed forward (graphs where it can) and sampling, for one patched model."""

    def __init__(self, model: torch.nn.Module, state: PatchState):
        self._model = weakref.ref(model)  # the model owns the state that owns this runner: no cycle
        self.state = weakref.proxy(state)  # the state owns this runner (through the engine): no cycle
        self.config = state.config
        self.device = state.input_device
        self.block_size = state.config.block_size
        self.supports_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.attention_fn = state.attention_function()
        self.single_device = all(layer.device == self.device for layer in state.layers)
        self.use_graphs = (
            self.device.type == "cuda"
            and self.single_device
            and state.use_triton
            and not state.config.enforce_eager
            and self.supports_logits_to_keep
        )
        max_len = state.max_model_len or state.num_blocks * self.block_size
        self.graph_width = padded_width(min(cdiv(max_len, self.block_size), state.num_blocks))
        long_from = state.long_rope.original if state.long_rope is not None else None
        self.batch = InputBatch(self.block_size, self.graph_width, long_from)
        self.sampler = Sampler()
        self.previous: StepResult | None = None  # the last step launched
        self.graphs: StepGraphs | None = None  # decode-only steps, by batch bucket
        self.mixed_graphs: StepGraphs | None = None  # steps with prefill tokens, by token bucket
        self.use_mixed_graphs = True  # off once their capture ran out of memory
        self.heap = HeapFreeze(state.config.freeze_gc)  # gc.freeze() after each capture (gc_heap.py)
        # compile=None (the default) compiles on CUDA; an error while compiling then falls back to eager layers
        self.compile = state.config.compile if state.config.compile is not None else self.device.type == "cuda"
        self._gemv = getattr(state.fused_projections, "num_gemv", 0) > 0  # one-row projections by the GEMV
        self._compiled = None
        self._compile_cache = None  # compile: the on-disk artifacts (compile_cache.py), found at first use
        self.kernel_warmup = KernelWarmup(self.state, self.device)  # Triton's variants, compiled at the first step
        self.capture_seconds = {"decode": 0.0, "mixed": 0.0}  # graph capture wall time, compiles included
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this hfpaged runner no longer exists")
        return model

    def reset(self) -> None:
        """Forget every request (after a failed step: the scheduler re-sends what it still runs)."""
        for state in self.batch.states.values():
            if state.beam_search is not None:
                state.beam_search.rollback()  # a round selected in the failed step (or one not yet read) is undone
        self.batch.reset()
        self.previous = None

    def drop_graphs(self) -> None:
        """Forget captured graphs and compiled code (they baked in the old weights' addresses)."""
        if self.device.type == "cuda" and (self.graphs is not None or self.mixed_graphs is not None):
            torch.cuda.synchronize(self.device)  # a replay may still run: its pool must not be reused under it
        self.finish_warmup(launch=False)  # workers still running: joined (the warm-up's launches wait for a step)
        self.graphs = None
        self.mixed_graphs = None
        self._compiled = None
        self.heap.thaw()  # what was frozen with them can be collected again

    # --- one step -------------------------------------------------------------------------------

    @torch.inference_mode()
    @no_autocast()
    def execute(self, out: SchedulerOutput) -> StepResult | None:
        """Launch one step; None when nothing is scheduled. The batch is brought up to date and the block
        copies run either way: a step that only preempts still swaps its victims out (autocast off throughout)."""
        self.batch.update(out)
        if out.swap_out or out.swap_in:
            self._swap(out)
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return None
        if not self.kernel_warmup.started:
            self.warmup()
        logits, host, greedy = self._forward_step(out)
        plain = all_plain_greedy(host.sample_states)
        if (
            not plain
            and self.previous is not None
            and any(s.params.stages_read_history or s.num_forks for s in host.sample_states)
        ):
            self.previous.result()  # this step's processors (or forks) read every earlier token
        # the graph's greedy picks are overwritten by its next replay; the next step reads these tokens (into its
        # inputs, and their copy to the host) on this stream before it replays anything
        self.previous = self.sampler.sample(
            logits, host.sample_states, host.sample_positions, greedy=greedy, plain=plain
        )
        return self.previous

    def _forward_step(self, out: SchedulerOutput) -> tuple[torch.Tensor, HostStep, torch.Tensor | None]:
        """(logits of the sampled rows, the host step, their argmax where a CUDA graph computed it)."""
        graphs, bucket = self._graphs_for(out)
        if graphs is not None:
            # the step's own (padded) table width: the graph reads only the [R, width] corner it is given
            host = self.batch.pack(out.scheduled, self.previous, pad_to=graphs.shape(bucket))
            graphs.load(self._stage(host.packed), bucket, host.width)
            self._fill_pending(graphs.input_ids(bucket), host.pending)
            self.num_graph_steps += 1
            logits = graphs.replay(bucket, host.num_sampled, host.max_seqlen_q)
            return logits, host, graphs.greedy_tokens(bucket, host.num_sampled, host.max_seqlen_q)
        self.finish_warmup()  # an eager forward launches every kernel at once: nothing left to overlap
        host = self.batch.pack(out.scheduled, self.previous)
        buffer = self._stage(host.packed).to(self.device, non_blocking=True)
        self._fill_pending(buffer[region_slices(host.num_tokens, host.num_reqs)["input_ids"]], host.pending)
        step = device_views(buffer, host)
        keep = None
        if not self.single_device and self.supports_logits_to_keep:
            # Layers on several devices: the model indexes its last hidden states (on whichever device the
            # final norm ran) with logits_to_keep. accelerate's hooks move tensor arguments to the first
            # device, so the indices go as a list of ints, which indexes a tensor on any device.
            keep = step.logits_indices.tolist()
        self.num_eager_steps += 1
        calibrate = calibration_step(self.state.calibration_pending, host.num_tokens)  # the first K/V stored
        logits = self.forward(step, logits_indices=keep, calibrate=calibrate)
        self.state.calibration_pending = False
        return logits, host, None

    # --- host -> device ---------------------------------------------------------------------------

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a CPU tensor the device can copy from asynchronously (pinned, on CUDA).

        Each step stages into its own pinned block from torch's caching host allocator, which does not hand
        a block out again until the copies reading it have run: a step may be prepared while the one before
        is still in flight.
        """
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host
        staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        staged.copy_(host)
        return staged

    def _fill_pending(self, input_ids: torch.Tensor, pending: np.ndarray | None) -> None:
        """Write the tokens the previous step sampled (still on the device) into this step's int32 input ids."""
        if pending is None:
            return
        index = self._stage(pending).to(input_ids.device, non_blocking=True)
        values = self.previous.tokens.to(input_ids.device, non_blocking=True).index_select(0, index[1])
        input_ids.index_copy_(0, index[0], values.to(input_ids.dtype))

    # --- forward ----------------------------------------------------------------------------------

    @contextmanager
    def _model_step(self) -> Iterator[None]:
        """What every paged forward of the model runs inside: paged attention on, eval mode, and for the step's
        duration the local-shard (tensor parallel), fused projection and per-token longrope forwards."""
        state = self.state
        with (
            paged_forward(state.attn_configs, state.forward_lock),
            eval_mode(self.model, state.weights.modules),
            local_step(state.local_tp),
            fused_step(state.fused_projections),
            long_rope_step(state.long_rope),
        ):
            yield

    def forward(
        self, step: DeviceStep, logits_indices: torch.Tensor | list[int] | int | None = None, calibrate: bool = False
    ) -> torch.Tensor:
        """The unmodified model over a packed step with paged attention; logits ``[n, vocab]``."""
        context = PagedStep(step.metadata, self.attention_fn, calibrate)
        keep = step.logits_indices if logits_indices is None else logits_indices
        kwargs = {"logits_to_keep": keep} if self.supports_logits_to_keep else {}
        with self._model_step():
            output = self.model(
                input_ids=step.input_ids, position_ids=step.position_ids, use_cache=False, hfpaged=context, **kwargs
            )
        logits = output.logits[0]
        if not self.supports_logits_to_keep:
            logits = logits.index_select(0, keep.to(logits.device)) if isinstance(keep, torch.Tensor) else logits
        return logits

    def warmup(self) -> None:
        """Compile the Triton kernel variants a run will meet up front (``kernel_warmup.py``): with compiled layers
        their compiles in worker processes run on beside the first layer compile."""
        self.kernel_warmup.start(overlap=self.compile)

    def finish_warmup(self, launch: bool = True) -> None:
        """Where our kernels must be ready: join the warm-up's workers, run its launches (``launch``)."""
        self.kernel_warmup.finish(launch)

    def _graph_forward(self, step: DeviceStep, mixed: bool = False) -> torch.Tensor:
        """The forward a CUDA graph captures: decode (every row sampled) or mixed (``step.logits_indices``), with
        compiled layers unless compile is off."""
        eager_keep = None if mixed else 0  # 0: every token of a decode batch is sampled
        if not self.compile or global_module_hooks():  # a global hook runs in every module: layers stay eager
            self.finish_warmup()
            return self.forward(step, logits_indices=eager_keep)
        if self._compiled is None:
            self._compiled = self._compile_step_forward()
        meta = step.metadata  # reaches the attention as forward kwargs: no step context needed
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        try:
            with self._model_step():
                logits = self._compiled(
                    self.model,
                    step.input_ids,
                    step.position_ids,
                    meta.slot_mapping,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.cu_seqlens_q,
                    max_seqlen_q=meta.max_seqlen_q,
                    logits_indices=step.logits_indices if mixed else None,
                )
        except Exception as error:
            # compile by default (None) must not cost a model that torch.compile cannot take its graphs: a
            # failed compile falls back to the eager layers for good. It is met outside a capture: the first
            # bucket's warm-up makes the trace, and a later bucket whose capture raises (a new shape's recompile)
            # is warmed up and captured again (StepGraphs.capture). compile=True asked for it: the error stands.
            if self.config.compile is not None or capturing or not _is_compile_error(error):
                raise
            logger.warning(
                "hfpaged: torch.compile failed (%s: %s); graph steps run eager layers", type(error).__name__, error
            )
            self.compile = False
            self._compiled = None
            return self.forward(step, logits_indices=eager_keep)
        if not capturing:
            self.finish_warmup()  # after the first (the layer compile's) forward, before any capture
            if self._compile_cache is not None:
                self._compile_cache.save()  # writes only when this forward compiled something the file lacks
        return logits

    def _compile_step_forward(self):
        """The compiled forward of graph steps, its on-disk artifacts loaded first (``compile_cache_dir``)."""
        from .compile_cache import CompileCache
        from .custom_ops import compile_step_forward

        max_seqlen_k = self.graph_width * self.block_size
        if self._compile_cache is None:  # built once: compile_step_forward below is cheap (no trace yet)
            options = {
                "block_size": self.block_size,
                "max_seqlen_k": max_seqlen_k,
                "kv_cache_dtype": self.config.kv_cache_dtype,
                "fuse_projections": bool(getattr(self.state.fused_projections, "groups", None)),
                "dependent_launch": self.state.dependent_launch,
                "gemv": self._gemv,
            }
            self._compile_cache = CompileCache.for_model(
                self.model, self.device, self.config.compile_cache_dir, options
            )
        if self._compile_cache is not None:
            self._compile_cache.load()
        return compile_step_forward(max_seqlen_k, launch_pdl=self.state.dependent_launch)

    def capture_graphs(self, mixed: bool = False) -> StepGraphs | None:
        """The decode CUDA graphs (``mixed``: those of steps with prefill tokens), captured now if they are not
        yet (otherwise done at the first such step); None where graphs are off."""
        captured = self.mixed_graphs if mixed else self.graphs
        if captured is None and self.use_graphs and (self.use_mixed_graphs or not mixed):
            graphs = StepGraphs(
                self.device,
                self.config.max_num_seqs,
                self.graph_width,
                self.block_size,
                mixed=mixed,
                max_num_tokens=self.config.max_num_batched_tokens,
                # compiled layers: a lone sequence pads into the 2-row graph, so dynamo traces one layer graph
                # (batch 1 would specialise a second one: seconds of every start for a few us per token), unless
                # one-row steps take the GEMV (gemv: ~0.1-0.5 ms per token, session 19)
                min_batch=2 if self.compile and not mixed and not self._gemv else 1,
                warm_smallest=self.compile and not mixed and self._gemv,
                short_prompt_hint=short_prompt_hint(self.state.layers) if mixed else None,
            )
            start = time.perf_counter()
            forward = functools.partial(self._graph_forward, mixed=True) if mixed else self._graph_forward
            captured_ok = self._capture(graphs, forward)
            self.capture_seconds["mixed" if mixed else "decode"] += time.perf_counter() - start
            if captured_ok:
                captured = graphs
                self.heap.freeze()
                if mixed:
                    self.mixed_graphs = graphs
                else:
                    self.graphs = graphs
        return captured

    def _capture(self, graphs: StepGraphs, forward) -> bool:
        try:
            graphs.capture(forward)
        except RuntimeError as error:  # e.g. a layer that synchronizes (some quantized matmuls)
            if graphs.mixed and isinstance(error, torch.OutOfMemoryError):  # the decode graphs may well fit
                logger.warning("hfpaged: the mixed-step CUDA graphs do not fit (%s); those steps run eagerly", error)
                self.use_mixed_graphs = False
                return False
            logger.warning("hfpaged: CUDA graph capture failed (%s); steps run eagerly", error)
            self.use_graphs = False
            self.graphs = self.mixed_graphs = None
            return False
        return True

    def _graphs_for(self, out: SchedulerOutput) -> tuple[StepGraphs | None, int | None]:
        """The captured graphs and bucket this step replays, or (None, None) to run it eagerly (a step nested in another
        too: a replay would overwrite the outputs, logits and greedy picks, that the enclosing step still reads)."""
        if not self.use_graphs or out.nested or self.state.calibration_pending:
            return None, None
        if self.batch.max_blocks(out.scheduled) > self.graph_width:
            return None, None
        num_tokens, num_reqs = out.num_batched_tokens, len(out.scheduled)
        # a decode step: one token per request (each has >= 1), every one sampled
        decode = num_tokens == num_reqs and all([s.samples for s in out.scheduled])
        graphs = self.capture_graphs(mixed=not decode)
        if graphs is None:
            return None, None
        bucket = graphs.bucket_for(num_tokens, num_reqs)
        return (graphs, bucket) if bucket is not None else (None, None)

    # --- block copies -----------------------------------------------------------------------------

    def _swap(self, out: SchedulerOutput) -> None:
        """Block copies the scheduler asked for, before the forward can overwrite freed GPU blocks."""
        swap = self.state.swap
        for gpu_ids, cpu_ids in out.swap_out:
            swap.copy_out(self.state.kv_caches, gpu_ids, cpu_ids)
        for cpu_ids, gpu_ids in out.swap_in:
            swap.copy_in(self.state.kv_caches, cpu_ids, gpu_ids)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (every layer's K and V) before this step writes them."""
        for k, v in self.state.kv_caches:
            k, v = as_bytes(k), as_bytes(v)  # fp8 blocks move as bytes
            src = torch.tensor([c[0] for c in copies], device=k.device)
            dst = torch.tensor([c[1] for c in copies], device=k.device)
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))


def _is_compile_error(error: Exception) -> bool:
    """An error raised by torch.compile's tracing or code generation (not by the model's own code run eagerly)."""
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "torch.fx", "torch._subclasses"))
