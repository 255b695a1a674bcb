"""``patch`` / ``unpatch`` / ``sleep`` / ``wake`` / ``stats`` / ``reset_prefix_cache``: hfpaged on and off a model
you already have (a transformers model, or a PEFT model wrapping one)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from .core.config import EngineConfig
from .engine import EngineCore, engine_of
from .generate import generate_many
from .model.attach import attach, check_options, detach, get_state
from .model.peft_compat import check_peft_model, inner_model
from .model.tensor_parallel import check_same_options
from .model.weights_version import placement, rewired_message
from .prompts import check_tokenizer
from .streaming import astream_many, stream_many

_METHODS = {"generate_many": generate_many, "stream_many": stream_many, "astream_many": astream_many}


class _ModelMethod:
    """``function`` bound to a model it holds weakly (a bound method stored on the model is a reference cycle)."""

    def __init__(self, function: Callable, model: PreTrainedModel):
        functools.update_wrapper(self, function)
        self._model = weakref.ref(model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(self._model(), *args, **kwargs)


def patch(
    model: PreTrainedModel,
    *,
    block_size: int = 16,
    num_blocks: int | None = None,
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    tokenizer: Any = None,
    **options: Any,
) -> PreTrainedModel:
    """Give every attention layer of ``model`` a paged KV cache in one shared block pool; add ``generate_many``.

    Extra ``options`` are :class:`EngineConfig` fields (``attention_backend``, ``enforce_eager``, ...).
    Patching again with the same settings only updates the tokenizer; other settings, attention weights moved to
    another dtype or device since (``model.to``), or attention layers added, replaced or reused since, re-patch.
    """
    check_tokenizer(tokenizer)
    unknown = set(options) - EngineConfig.field_names()
    if unknown:
        raise TypeError(f"patch() got unknown options {sorted(unknown)}; valid: {sorted(EngineConfig.field_names())}")
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        gpu_memory_utilization=gpu_memory_utilization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        **options,
    )
    check_peft_model(model)
    target = _target(model, "patch")  # a PEFT model's inner transformers model (it reaches the rest through it)
    _check_materialized(target)
    existing = getattr(target, "_hfpaged", None)
    if existing is not None:
        if existing.tp is not None:  # every rank patches again with the same settings (a no-op too), or none does
            check_same_options(existing.tp, config)
        now = placement(existing.layers)
        if existing.config == config and now == existing.placement and rewired_message(target, existing) is None:
            if tokenizer is not None:
                existing.tokenizer = tokenizer
            return model
        # options the devices refuse are refused before the working patch (and what runs on it) is taken off
        check_options([dataclasses.replace(r, device=p[1]) if p else r for r, p in zip(existing.layers, now)], config)
        tokenizer = tokenizer if tokenizer is not None else existing.tokenizer
        unpatch(target)
    state = attach(target, config, tokenizer)
    state.engine = EngineCore(target, state)  # the model's one engine, before any caller can race to make it
    for name, function in _METHODS.items():
        setattr(target, name, _ModelMethod(function, target))
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Remove what ``patch`` added: layer bindings, ``generate_many``, the forward lock, the pool (memory released).

    Requests still running on the model (other threads, suspended streams) are aborted first.
    """
    target = _target(model, "unpatch")
    state = getattr(target, "_hfpaged", None)
    if state is None:
        return model
    engine = state.engine
    # the engine's lock throughout: a handle on it (another thread's, the server's) adds and steps nothing between
    # the aborts and the detach, and adds nothing after it (closed)
    with engine.lock if engine is not None else contextlib.nullcontext():
        if engine is not None:
            engine.abort_everything()  # their callers (threads, streams, Engine handles) see them end
            engine.runner.drop_graphs()  # also undoes the runner's gc.freeze() (EngineConfig.freeze_gc)
            engine.closed = True
        for name in _METHODS:
            target.__dict__.pop(name, None)
        detach(target)
    return model


def _target(model: Any, verb: str) -> Any:
    """The transformers model ``patch``/``unpatch`` work on (a PEFT model's inner one); a ``torch.compile`` wrapper
    (or anything else that is not a transformers model) is refused: the patch belongs on the model itself."""
    target = inner_model(model)
    if isinstance(target, PreTrainedModel) or not isinstance(model, torch.nn.Module):
        return target  # not a module at all: patch's check_model names it
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")  # torch.compile's OptimizedModule
    wrapped = f" (torch.compile's wrapper of {type(inner).__name__}): pass the model itself, compiled._orig_mod"
    raise TypeError(
        f"hfpaged.{verb} expects a transformers PreTrainedModel, got {type(model).__name__}"
        + (wrapped if inner is not None else "")
    )


def _check_materialized(model: torch.nn.Module) -> None:
    """Refuse a model whose input embeddings are on the meta device (accelerate's ``cpu_offload``/``disk_offload``, a
    ``device_map`` that puts them, or everything, on ``"disk"``): hfpaged runs its steps on their device. Other
    modules offloaded to disk are loaded by their hooks as in stock calls."""
    if not isinstance(model, PreTrainedModel) or model.get_input_embeddings() is None:
        return  # check_model names it
    embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
    name = next((n for n, p in model.named_parameters() if id(p) in embeddings and p.device.type == "meta"), None)
    if name is not None:
        raise ValueError(
            f"hfpaged cannot patch {type(model).__name__}: parameter {name!r} is on the meta device (weights offloaded "
            "by accelerate: cpu_offload, disk_offload or a device_map that puts them on 'disk'); hfpaged runs its "
            "steps on the input embeddings' device and needs their weights materialized there: load the model "
            "without offloading them"
        )


def sleep(model: PreTrainedModel) -> None:
    """Release the KV pool, CUDA graphs, compiled code and sampling tables (GPU memory back to about what the
    model alone takes), e.g. for a training step; the next call (or ``wake``) allocates them again. Nothing
    may be running on the model."""
    engine_of(model).sleep()


def wake(model: PreTrainedModel) -> None:
    """Allocate the pool released by ``sleep`` again now (otherwise the next call does)."""
    engine_of(model).wake()


def reset_prefix_cache(model: PreTrainedModel) -> None:
    """Forget every cached prefix block (``generate_many`` also does this by itself when the weights changed)."""
    core = engine_of(model)
    with core.lock:
        core.kv.reset_prefix_cache()


def stats(model: PreTrainedModel) -> dict[str, Any]:
    """Pool and scheduler figures: ``num_blocks``, ``num_free_blocks``, ``gpu_cache_usage``, the KV dtype and bytes
    per token (``kv_cache_dtype``, ``kv_cache_bytes_per_token``, fp8 ``kv_cache_scale_source``), counters, queues."""
    state = get_state(model)
    core = engine_of(model)
    with core.lock:
        core.reap_orphans()  # prompts of dropped Engine handles do not count as running
        kv = core.kv
        return {
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "block_size": state.config.block_size,
            "gpu_cache_usage": 1.0 - kv.num_free_blocks / kv.num_blocks,
            "num_layers": len(state.layers),
            "kv_cache_dtype": str(state.kv_cache_dtype or state.layers[0].dtype).removeprefix("torch."),
            "kv_cache_bytes_per_token": sum(state.block_bytes().values()) // state.config.block_size,
            "kv_cache_scale_source": state.kv_scale_source,
            "num_cpu_blocks": state.num_cpu_blocks,
            "num_free_cpu_blocks": kv.cpu_pool.num_free_blocks if kv.cpu_pool is not None else 0,
            "asleep": state.asleep,
            "tensor_parallel_size": state.tp.world_size if state.tp is not None else 1,
            "num_running_requests": len(core.scheduler.running),
            "num_waiting_requests": len(core.scheduler.waiting) + len(core.scheduler.swapped),
            **state.counters,
        }
