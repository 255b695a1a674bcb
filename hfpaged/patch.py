"""``patch`` / ``unpatch``: find a model's attention layers, give them one shared paged KV pool."""

from __future__ import annotations

import inspect
import logging
import math
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_utils import AttentionInterface

from .attention import (
    ATTENTION_NAME,
    ForwardContext,
    LayerRecord,
    UnsupportedModelError,
    paged_attention_forward,
    paged_attention_torch,
    store_kv_torch,
)
from .block_pool import BlockPool
from .config import EngineConfig
from .scheduler import COUNTER_NAMES

logger = logging.getLogger("hfpaged")

AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@dataclass
class PatchState:
    """Everything ``patch`` attaches to a model (as ``model._hfpaged``)."""

    config: EngineConfig
    layers: list[LayerRecord]
    attn_configs: list[PretrainedConfig]
    input_device: torch.device
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    pool: BlockPool | None = None
    tokenizer: Any = None
    vocab_size: int = 0
    max_model_len: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    runner: Any = None
    swap: Any = None  # SwapSpace when preemption_mode == "swap"

    @property
    def uses_cuda(self) -> bool:
        return all(layer.device.type == "cuda" for layer in self.layers)

    @property
    def use_triton(self) -> bool:
        backend = self.config.attention_backend
        if backend == "torch":
            return False
        if backend == "triton":
            return True
        return self.uses_cuda and all(layer.head_dim == layer.head_dim_v for layer in self.layers)

    def attention_functions(self) -> tuple[Callable, Callable]:
        """(store_kv, paged_attention) for this model: Triton kernels on CUDA, else the torch reference."""
        if self.use_triton:
            from .kernels import paged_attention, store_kv

            return store_kv, paged_attention
        return store_kv_torch, paged_attention_torch

    def block_bytes(self) -> dict[torch.device, int]:
        """Bytes one block takes on each device (K and V of every layer there)."""
        per_device: dict[torch.device, int] = {}
        bs = self.config.block_size
        for layer in self.layers:
            elem = torch.empty((), dtype=layer.dtype).element_size()
            size = bs * layer.num_kv_heads * (layer.head_dim + layer.head_dim_v) * elem
            per_device[layer.device] = per_device.get(layer.device, 0) + size
        return per_device


def _collect_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
    """Every config object a module of the model reads ``_attn_implementation`` from."""
    found: dict[int, PretrainedConfig] = {}

    def visit(cfg: PretrainedConfig) -> None:
        if id(cfg) in found:
            return
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            sub = getattr(cfg, key, None)
            if isinstance(sub, PretrainedConfig):
                visit(sub)

    for module in model.modules():
        cfg = getattr(module, "config", None)
        if isinstance(cfg, PretrainedConfig):
            visit(cfg)
    return list(found.values())


def _check_model(model: Any) -> None:
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hfpaged.patch expects a transformers PreTrainedModel, got {name}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; hfpaged supports decoder-only causal LMs")
    if not (hasattr(model, "generate") and model.can_generate()):
        raise TypeError(f"{name} cannot generate (not a causal LM with a language-modeling head)")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{name} has no output embeddings (language-modeling head); load it with AutoModelForCausalLM")


def _discover_layers(model: torch.nn.Module, state_configs: list[PretrainedConfig], device: torch.device) -> list[LayerRecord]:
    """Run a 2-token forward with a recording attention function to find every attention layer."""
    from .runner import paged_mode

    context = ForwardContext("discover")
    probe = types.SimpleNamespace(attn_configs=state_configs)
    input_ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    position_ids = torch.arange(2, device=device)[None]
    name = type(model).__name__
    try:
        with torch.inference_mode(), paged_mode(probe, context):
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # the model rejected the packed call: not usable with hfpaged
        raise UnsupportedModelError(
            f"{name} failed a packed forward through the hfpaged attention implementation "
            f"({type(exc).__name__}: {exc}); its attention is not reachable through transformers' AttentionInterface"
        ) from exc
    finally:
        for record in context.records:
            record.module.__dict__.pop("_hfpaged_discovered", None)
    if not context.records:
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface "
            "(config._attn_implementation is ignored by its attention code), so hfpaged cannot page its KV cache. "
            "Falcon, GPT-J and Bloom are known to be unsupported."
        )
    return context.records


def _max_model_len(model: PreTrainedModel) -> int | None:
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if value else None


def _size_pool(model: torch.nn.Module, state: PatchState) -> int:
    config = state.config
    if config.num_blocks is not None:
        return config.num_blocks
    per_device = state.block_bytes()
    max_len = state.max_model_len or 4096
    upper = config.max_num_seqs * math.ceil(max_len / config.block_size)
    if not state.uses_cuda:
        budget = int(config.cpu_kv_cache_gib * (1 << 30))
        return max(1, min(upper, budget // sum(per_device.values())))
    return _size_pool_cuda(model, state, per_device, upper)


def _size_pool_cuda(model: torch.nn.Module, state: PatchState, per_device: dict, upper: int) -> int:
    """Profile one forward at max_num_batched_tokens, give gpu_memory_utilization of memory to the pool."""
    from .runner import paged_mode

    config = state.config
    devices = sorted(per_device, key=str)
    for dev in devices:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    num_tokens = config.max_num_batched_tokens
    seq_len = min(num_tokens, state.max_model_len or num_tokens)
    positions = torch.arange(num_tokens, device=state.input_device) % seq_len
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=state.input_device)
    num_logits = min(config.max_num_seqs, num_tokens)
    kwargs = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = torch.arange(num_tokens - num_logits, num_tokens, device=state.input_device)
    context = ForwardContext("discover")
    with torch.inference_mode(), paged_mode(state, context):
        model(input_ids=input_ids, position_ids=positions[None], use_cache=False, **kwargs)
    for record in context.records:
        record.module.__dict__.pop("_hfpaged_discovered", None)
    num_blocks = upper
    for dev in devices:
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        reserved = torch.cuda.memory_reserved(dev)
        non_torch = total - free - reserved
        headroom = 512 << 20  # CUDA graphs, sampling buffers, allocator slack
        budget = int(total * config.gpu_memory_utilization) - non_torch - peak - headroom
        if budget <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache on {dev}: {total / 2**30:.1f} GiB total, "
                f"{peak / 2**30:.1f} GiB peak for the model, gpu_memory_utilization={config.gpu_memory_utilization}"
            )
        num_blocks = min(num_blocks, budget // per_device[dev])
    return max(1, int(num_blocks))


def _allocate_caches(state: PatchState, num_blocks: int) -> None:
    bs = state.config.block_size
    state.kv_caches = [
        (
            torch.zeros(num_blocks, bs, layer.num_kv_heads, layer.head_dim, dtype=layer.dtype, device=layer.device),
            torch.zeros(num_blocks, bs, layer.num_kv_heads, layer.head_dim_v, dtype=layer.dtype, device=layer.device),
        )
        for layer in state.layers
    ]
    state.pool = BlockPool(num_blocks)
    for layer, caches in zip(state.layers, state.kv_caches):
        layer.module._hfpaged_kv = caches
    if state.config.preemption_mode == "swap":
        from .swap import SwapSpace

        state.swap = SwapSpace(state.kv_caches, state.config.swap_space)


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
    Patching again with the same settings only updates the tokenizer; other settings re-patch.
    """
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
    existing = getattr(model, "_hfpaged", None)
    if existing is not None:
        if existing.config == config:
            if tokenizer is not None:
                existing.tokenizer = tokenizer
            return model
        tokenizer = tokenizer if tokenizer is not None else existing.tokenizer
        unpatch(model)
    _check_model(model)

    input_device = model.get_input_embeddings().weight.device
    attn_configs = _collect_configs(model)
    layers = _discover_layers(model, attn_configs, input_device)
    state = PatchState(
        config=config,
        layers=layers,
        attn_configs=attn_configs,
        input_device=input_device,
        tokenizer=tokenizer,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        max_model_len=_max_model_len(model),
        counters=dict.fromkeys(COUNTER_NAMES, 0),
    )
    try:
        pool_blocks = _size_pool(model, state)
        _allocate_caches(state, pool_blocks)
    except BaseException:
        for layer in layers:
            layer.module.__dict__.pop("_hfpaged_kv", None)
        raise
    gib = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in state.kv_caches) / 2**30
    logger.info(
        "hfpaged: KV pool of %d blocks x %d tokens (%.2f GiB, %d tokens) over %d layers",
        pool_blocks,
        config.block_size,
        gib,
        pool_blocks * config.block_size,
        len(layers),
    )
    model._hfpaged = state

    from .engine import generate_many
    from .streaming import astream_many, stream_many

    model.generate_many = types.MethodType(generate_many, model)
    model.stream_many = types.MethodType(stream_many, model)
    model.astream_many = types.MethodType(astream_many, model)
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Remove what ``patch`` added: layer bindings, ``generate_many`` and the pool (memory is released)."""
    state = getattr(model, "_hfpaged", None)
    if state is None:
        return model
    for layer in state.layers:
        layer.module.__dict__.pop("_hfpaged_kv", None)
    for name in ("generate_many", "stream_many", "astream_many"):
        model.__dict__.pop(name, None)
    if state.runner is not None and hasattr(state.runner, "close"):
        state.runner.close()
    state.kv_caches = []
    state.pool = None
    state.runner = None
    state.swap = None
    del model._hfpaged
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


def get_state(model: Any) -> PatchState:
    state = getattr(model, "_hfpaged", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not patched; call hfpaged.patch(model) first")
    return state


def stats(model: PreTrainedModel) -> dict[str, Any]:
    """Pool and scheduler figures: ``num_blocks``, ``num_free_blocks``, ``gpu_cache_usage``, counters."""
    state = get_state(model)
    pool = state.pool
    return {
        "num_blocks": pool.num_blocks,
        "num_free_blocks": pool.num_free_blocks,
        "block_size": state.config.block_size,
        "gpu_cache_usage": pool.num_used_blocks / pool.num_blocks,
        "num_layers": len(state.layers),
        "num_cpu_blocks": state.swap.num_blocks if state.swap is not None else 0,
        "num_free_cpu_blocks": state.swap.pool.num_free_blocks if state.swap is not None and state.swap.pool else 0,
        **state.counters,
    }
