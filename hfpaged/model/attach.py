"""Attaching hfpaged to a model and taking it off again: layer bindings, the KV pool, the forward lock.

``attach`` finds the attention layers, allocates one shared block pool (a block id names the same slots
in every layer's K and V), binds each layer's caches (``module._hfpaged_kv``) and wraps ``model.forward``
so stock calls take the model's forward lock, which paged forwards hold while the attention is switched
(see ``attention.paged_forward``). Everything hangs off ``model._hfpaged`` (a ``PatchState``) and nothing
in it refers back to the model, so ``del model`` frees the pool at once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ..core.config import EngineConfig
from . import hf_compat
from .attention import LayerRecord, check_attention_implementation
from .fused_projections import FusedProjections, fuse_projections
from .kv_cache import (
    allocate_caches,
    block_bytes,
    check_model,
    collect_configs,
    discover_layers,
    max_model_len,
    position_table,
    size_pool,
    window_length_limit,
    window_signature,
)
from .kv_quant import cache_dtype, check_fp8_device, given_scales, initial_scales
from .long_rope import LongRope, find_long_rope
from .swap_space import SwapSpace, swap_blocks
from .tensor_parallel import TensorParallel, check_same_options, find_tensor_parallel
from .tp_local import LocalProjections, local_projections
from .weights_version import WeightsVersion, attention_paths, placement

logger = logging.getLogger("hfpaged")


@dataclass
class PatchState:
    """Everything ``patch`` attaches to a model (as ``model._hfpaged``)."""

    config: EngineConfig
    layers: list[LayerRecord]
    attn_configs: list[PretrainedConfig]
    input_device: torch.device
    forward_lock: threading.RLock
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    weights: WeightsVersion
    swap: SwapSpace | None = None
    tokenizer: Any = None
    vocab_size: int = 0
    max_model_len: int | None = None
    length_limit: tuple[int, str] | None = None  # (positions, why): dynamic/longrope RoPE, windows not passed
    position_table: tuple[int, str] | None = None  # (positions, which): a learned absolute position table's rows
    counters: dict[str, int] = field(default_factory=dict)  # shared with the scheduler (hfpaged.stats)
    engine: Any = None  # the model's one EngineCore (hfpaged.engine), created by patch
    asleep: bool = False  # the pool is released (hfpaged.sleep); the next call allocates it again
    previous_forward: Callable | None = None  # an instance-level forward that was there before ours
    kv_cache_dtype: torch.dtype | None = None  # fp8 cache dtype; None: each layer's own dtype
    kv_scales: list[torch.Tensor] = field(default_factory=list)  # fp8: per layer [2] float32 (k_scale, v_scale)
    kv_scale_source: str | None = None  # fp8: "user", "checkpoint" or "calibration"
    calibration_pending: bool = False  # the next eager forward that stores K/V sets the scales first
    recalibrate_when_idle: bool = False  # weights changed while requests ran: calibrate once nothing runs
    fused_projections: FusedProjections | None = None  # q/k/v and gate/up weights moved into one buffer each
    tp: TensorParallel | None = None  # the tensor-parallel group transformers sharded the model over
    local_tp: LocalProjections | None = None  # a sharded model's projections on local shards in the paged step
    long_rope: LongRope | None = None  # longrope rotary modules served past their short length (long_rope.py)
    rope_limit: tuple[int, str] | None = None  # the RoPE part of length_limit (the window part follows the config)
    window_signature: tuple = ()  # the config's sliding-window fields when length_limit was last computed
    attention_paths: dict[int, tuple[Any, int]] = field(default_factory=dict)  # modules of the paged classes at patch
    placement: tuple = ()  # the attention layers' weights' (dtype, device) at patch (weights_version.placement)
    moved: str | None = None  # why the model cannot run now that its weights moved off that placement, if they did

    def block_bytes(self) -> dict[torch.device, int]:
        """Bytes one block takes on each device."""
        return block_bytes(self.layers, self.config.block_size, self.kv_cache_dtype)

    @property
    def uses_cuda(self) -> bool:
        return all(layer.device.type == "cuda" for layer in self.layers)

    @property
    def num_cpu_blocks(self) -> int:
        return self.swap.num_blocks if self.swap is not None else 0

    @property
    def use_triton(self) -> bool:
        backend = self.config.attention_backend
        if backend == "torch":
            return False
        if backend == "triton":
            return True
        return self.uses_cuda and wide_heads(self.layers) is None

    @property
    def dependent_launch(self) -> bool:
        """Whether the Triton kernels launch with programmatic dependent launch (``EngineConfig.dependent_launch``;
        every layer's device must support it). The default leaves it off under tensor parallelism, where it has
        not run yet (no two-GPU machine since it was built); ``True`` turns it on there too."""
        if self.config.dependent_launch is False or not self.use_triton:
            return False
        if self.config.dependent_launch is None and self.tp is not None:
            return False
        from ..kernels.dependent_launch import dependent_launch_supported

        return all(dependent_launch_supported(layer.device) for layer in self.layers)

    def attention_function(self) -> Callable:
        """paged_attention for this model (it stores the step's K/V too): the Triton kernels on CUDA, else the torch
        reference."""
        from .. import kernels

        if self.use_triton:
            return functools.partial(kernels.paged_attention, launch_pdl=self.dependent_launch)
        return kernels.paged_attention_reference


def get_state(model: Any) -> PatchState:
    state = getattr(model, "_hfpaged", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call hfpaged.patch(model) first")
    return state


def _wrap_forward(model: torch.nn.Module, lock: threading.RLock) -> Callable | None:
    """Make ``model.forward`` take the forward lock; returns the instance-level forward it replaced, if any.

    The wrapper holds the model weakly (no reference cycle) and shows the original signature (generate
    inspects it, e.g. for ``logits_to_keep``).
    """
    previous = model.__dict__.get("forward")
    unbound = type(model).forward
    model_ref = weakref.ref(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        with lock:
            if previous is not None:
                return previous(*args, **kwargs)
            return unbound(model_ref(), *args, **kwargs)

    functools.update_wrapper(forward, unbound, updated=())
    del forward.__wrapped__
    forward.__signature__ = inspect.signature(previous if previous is not None else model.forward)
    forward._hfpaged_forward = True
    model.forward = forward
    return previous


def attach(model: PreTrainedModel, config: EngineConfig, tokenizer: Any = None) -> PatchState:
    """Give every attention layer of ``model`` a paged KV cache in one shared pool; returns the state."""
    check_model(model)
    tp = find_tensor_parallel(model)
    if tp is not None:
        check_same_options(tp, config)  # every rank refuses together
    projections = None
    if tp is not None:  # collective: the one-shot all-reduce's buffer is symmetric over the ranks
        projections = local_projections(model, tp.model_group, model.get_input_embeddings().weight.device)
    try:
        fused = fuse_projections(model, config.fuse_projections, projections)  # first: the pool is sized after it
    except BaseException:
        if projections is not None:
            projections.close()
        raise
    try:
        return _attach(model, config, tokenizer, fused, tp, projections)
    except BaseException:
        fused.unfuse()
        if projections is not None:
            projections.close()
        raise


def _attach(
    model: PreTrainedModel,
    config: EngineConfig,
    tokenizer: Any,
    fused: FusedProjections,
    tp: TensorParallel | None,
    projections: LocalProjections | None,
) -> PatchState:
    input_device = model.get_input_embeddings().weight.device
    attn_configs = collect_configs(model)
    check_attention_implementation(attn_configs)
    lock = threading.RLock()
    layers = discover_layers(model, attn_configs, input_device, lock)
    _check_owners(model, layers)
    long_rope = find_long_rope(model, input_device, lock)
    rope_limit = hf_compat.rope_length_limit(model, served=("longrope",) if long_rope is not None else ())
    model_len = max_model_len(model)
    kv_dtype = cache_dtype(config.kv_cache_dtype)
    check_options(layers, config)
    length_limit = min((limit for limit in (rope_limit, window_length_limit(model, layers)) if limit), default=None)
    profile_len = min(model_len or length_limit[0], length_limit[0]) if length_limit else model_len
    num_blocks = size_pool(model, config, layers, attn_configs, input_device, profile_len, lock, long_rope)
    if tp is not None:
        num_blocks = tp.min_int(num_blocks)  # a block id names the same slots on every rank
    kv_caches = allocate_caches(layers, num_blocks, config.block_size, kv_dtype)
    swap = None
    if config.preemption_mode == "swap":
        num_cpu_blocks = swap_blocks(
            config.swap_space, num_blocks, sum(block_bytes(layers, config.block_size, kv_dtype).values())
        )
        if tp is not None:
            num_cpu_blocks = tp.min_int(num_cpu_blocks)
        swap = SwapSpace(num_cpu_blocks) if num_cpu_blocks > 0 else None
    state = PatchState(
        config=config,
        layers=layers,
        attn_configs=attn_configs,
        input_device=input_device,
        forward_lock=lock,
        kv_caches=kv_caches,
        num_blocks=num_blocks,
        weights=WeightsVersion(model),
        swap=swap,
        tokenizer=tokenizer,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        max_model_len=model_len,
        length_limit=length_limit,
        position_table=position_table(model),
        kv_cache_dtype=kv_dtype,
        fused_projections=fused,
        tp=tp,
        local_tp=projections,
        long_rope=long_rope,
        placement=placement(layers),
        rope_limit=rope_limit,
        window_signature=window_signature(model),
        attention_paths=attention_paths(model, layers),
    )
    if config.gemv or (config.gemv is None and state.dependent_launch):
        fused.enable_gemv(model, launch_pdl=state.dependent_launch)
    if kv_dtype is not None:
        state.kv_scales, state.kv_scale_source = initial_scales(layers, config)
        state.calibration_pending = state.kv_scale_source == "calibration"
        for layer, scales in zip(layers, state.kv_scales):
            layer.module._hfpaged_kv_scale = (scales, scales[0:1], scales[1:2])  # whole, k_scale, v_scale views
    bind_caches(state, kv_caches)
    for layer in layers:
        layer.module._hfpaged_owner = weakref.ref(model)
    state.previous_forward = _wrap_forward(model, lock)
    gib = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches) / 2**30
    logger.info(
        "hfpaged: KV pool of %d blocks x %d tokens (%.2f GiB, %d tokens, %s) over %d layers",
        num_blocks,
        config.block_size,
        gib,
        num_blocks * config.block_size,
        str(kv_caches[0][0].dtype).removeprefix("torch."),
        len(layers),
    )
    model._hfpaged = state
    return state


def _check_owners(model: torch.nn.Module, layers: list[LayerRecord]) -> None:
    """Refuse attention modules another live patched model holds (``c.model = b.model``): each model binds its own
    pool to them, and the two would write each other's blocks."""
    for index, layer in enumerate(layers):
        ref = layer.module.__dict__.get("_hfpaged_owner")
        owner = ref() if ref is not None else None
        if owner is not None and owner is not model:
            raise ValueError(
                f"attention layer {index} ({type(layer.module).__name__}) belongs to another patched model too "
                f"({type(owner).__name__} at {id(owner):#x}): two patched models cannot share attention modules, each "
                "binds its own KV pool to them; unpatch the other model first"
            )


def check_options(layers: list[LayerRecord], config: EngineConfig) -> None:
    """Raise ValueError for options the layers cannot take (fp8 caches on their devices and one scale pair per layer,
    Triton kernels); ``patch`` runs it before taking an existing patch off, so a refused re-patch leaves that one
    working."""
    kv_dtype = cache_dtype(config.kv_cache_dtype)
    if kv_dtype is not None:
        for device in {layer.device for layer in layers}:
            check_fp8_device(device, kv_dtype, config.kv_cache_dtype)
        given_scales(layers, config)
    if config.dependent_launch:
        check_dependent_launch(layers, config.attention_backend)
    if config.gemv:
        check_triton_devices(layers, "gemv=True", "leave gemv None or False there")
    if config.attention_backend == "triton":
        check_triton_devices(layers, "attention_backend='triton'", "use 'auto' or 'torch' there")
        if (wide := wide_heads(layers)) is not None:
            raise ValueError(f"attention_backend='triton': {wide}; use 'auto' (the torch attention for this model)")


def check_dependent_launch(layers: list[LayerRecord], attention_backend: str) -> None:
    """Raise ValueError unless every layer's device can run the Triton kernels with programmatic dependent launch
    (``dependent_launch=True`` asks for it; None takes it where it is supported)."""
    from ..kernels.dependent_launch import check_launch_pdl

    if attention_backend == "torch":
        raise ValueError("dependent_launch=True applies to the Triton kernels; attention_backend='torch' runs none")
    for device in sorted({layer.device for layer in layers}, key=str):
        check_launch_pdl(True, device, "dependent_launch")


def check_triton_devices(layers: list[LayerRecord], option: str, fix: str) -> None:
    """Raise ValueError unless Triton kernels can run on every layer's device (``option`` asks for them): CUDA, or
    Triton's CPU interpreter."""
    from ..kernels._checks import interpreting

    devices = sorted({layer.device for layer in layers}, key=str)
    if any(device.type != "cuda" for device in devices) and not interpreting():
        raise ValueError(
            f"{option} runs Triton kernels: it needs CUDA devices (or TRITON_INTERPRET=1), got "
            f"{', '.join(map(str, devices))}; {fix}"
        )


def wide_heads(layers: list[LayerRecord]) -> str | None:
    """Why the Triton kernels cannot take the model's heads (a head wider than they take), or None."""
    from ..kernels._checks import MAX_HEAD_DIM

    for index, layer in enumerate(layers):
        if max(layer.head_dim, layer.head_dim_v) > MAX_HEAD_DIM:
            return (
                f"attention layer {index} has query/key heads of {layer.head_dim} and value heads of "
                f"{layer.head_dim_v}; the Triton kernels take heads of at most {MAX_HEAD_DIM}"
            )
    return None


def bind_caches(state: PatchState, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each attention layer its K/V (``module._hfpaged_kv``); the state keeps the list."""
    state.kv_caches = kv_caches
    for layer, caches in zip(state.layers, kv_caches):
        layer.module._hfpaged_kv = caches


def release_caches(state: PatchState) -> None:
    """Drop every layer's K/V and the swap space (their memory goes back once nothing else holds them)."""
    for layer in state.layers:
        layer.module.__dict__.pop("_hfpaged_kv", None)
    state.kv_caches = []
    if state.swap is not None:
        state.swap.caches = []


def reallocate_caches(state: PatchState) -> None:
    """The K/V of a released pool again, as many blocks as before (their contents are not kept)."""
    bind_caches(state, allocate_caches(state.layers, state.num_blocks, state.config.block_size, state.kv_cache_dtype))


def detach(model: PreTrainedModel) -> None:
    """Undo ``attach``: layer bindings, the forward wrapper, the pool (its memory is released)."""
    state = getattr(model, "_hfpaged", None)
    if state is None:
        return
    with state.forward_lock:
        release_caches(state)
        if state.fused_projections is not None:
            state.fused_projections.unfuse()
        if state.local_tp is not None:
            state.local_tp.close()
        for layer in state.layers:
            layer.module.__dict__.pop("_hfpaged_kv_scale", None)
            layer.module.__dict__.pop("_hfpaged_owner", None)
        if getattr(model.__dict__.get("forward"), "_hfpaged_forward", False):
            del model.forward
            if state.previous_forward is not None:
                model.forward = state.previous_forward
        del model._hfpaged
    state.engine = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
