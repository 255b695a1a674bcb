"""Finding a model's attention layers, sizing the shared block pool, and allocating every layer's K/V.

Discovery runs one tiny packed forward with ``hfpaged=Discovery()``: every layer whose attention goes
through transformers' ``AttentionInterface`` reports its heads, head dims, dtype, device, sliding window and
softcap. The pool (in the model's dtype, or fp8 with ``kv_cache_dtype``) is sized from ``num_blocks``, or from free GPU memory after a profiling forward at
``max_num_batched_tokens`` (``gpu_memory_utilization`` of the card), or ``cpu_kv_cache_gib`` elsewhere.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from ..core.block_pool import cdiv
from ..core.config import EngineConfig
from .attention import Discovery, LayerRecord, UnsupportedModelError, paged_forward, probing
from .kv_quant import cache_dtype
from .long_rope import LongRope, long_rope_step

CUDA_HEADROOM_BYTES = 512 << 20  # CUDA graphs, sampling buffers, allocator slack


def collect_configs(model: torch.nn.Module) -> list[PretrainedConfig]:
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


def check_model(model: Any) -> None:
    """Raise TypeError/ValueError (naming the class) for a model hfpaged cannot serve."""
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"hfpaged.patch expects a transformers PreTrainedModel, got {name}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; hfpaged supports decoder-only causal LMs")
    if not (hasattr(model, "generate") and model.can_generate()):
        raise TypeError(f"{name} cannot generate (not a causal LM with a language-modeling head)")
    if model.get_output_embeddings() is None:
        raise TypeError(f"{name} has no output embeddings (language-modeling head); load it with AutoModelForCausalLM")


PAGED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(model: torch.nn.Module) -> None:
    """Refuse models with layers the paged forward cannot serve: chunked attention (its mask would be ignored),
    or recurrent layers (linear attention, Mamba, convolutions) whose state lives outside a KV cache. Only the
    decoder's config counts: a vision tower's layers never run in text generation."""
    config = model.config
    for cfg in [config.get_text_config(decoder=True)] if hasattr(config, "get_text_config") else [config]:
        layer_types = getattr(cfg, "layer_types", None)
        if not isinstance(layer_types, (list, tuple)):
            continue
        other = sorted({str(kind) for kind in layer_types} - set(PAGED_LAYER_TYPES))
        if other:
            raise UnsupportedModelError(
                f"{type(model).__name__} has layers of type {', '.join(other)} ({type(cfg).__name__}.layer_types); "
                f"hfpaged serves models whose layers are all {' or '.join(PAGED_LAYER_TYPES)}"
            )


def check_batch_dependent_modules(model: torch.nn.Module) -> None:
    """Refuse torch's dynamically quantized modules (``torch.ao.quantization.quantize_dynamic``): they pick one
    activation scale per call from the whole input, so a prompt's numbers depend on what its packed step holds
    besides it (other prompts, a cached prefix), and tokens differ from stock ``generate`` on the prompt alone."""
    dynamic = getattr(getattr(torch.ao.nn, "quantized", None), "dynamic", None)
    kinds = tuple(getattr(dynamic, name) for name in ("Linear", "LSTM", "GRU") if hasattr(dynamic, name))
    for name, module in model.named_modules():
        if kinds and isinstance(module, kinds):
            raise UnsupportedModelError(
                f"{type(model).__name__}.{name} is a dynamically quantized {type(module).__name__} (quantize_dynamic): "
                "it scales its input per call, over everything a packed step holds, so hfpaged's batched steps "
                "would give other tokens than stock generate on each prompt alone. Serve the float model, or "
                "quantize its weights only (e.g. bitsandbytes, torchao weight-only)"
            )


def discover_layers(
    model: torch.nn.Module, configs: list[PretrainedConfig], device: torch.device, lock: threading.RLock
) -> list[LayerRecord]:
    """Run a 2-token forward with a recording attention function to find every attention layer; refuse a model
    whose queries and keys do not follow the ``position_ids`` it is given (a second forward with them swapped)."""
    check_layer_types(model)
    check_batch_dependent_modules(model)
    name = type(model).__name__
    first = _probe(model, configs, device, lock, [0, 1])
    if not first.records:
        raise UnsupportedModelError(
            f"{name} does not route attention through transformers' AttentionInterface "
            "(config._attn_implementation is ignored by its attention code), so hfpaged cannot page its KV cache. "
            "Falcon, Bloom and GPT-J before transformers 5.24 are known to be unsupported."
        )
    swapped = _probe(model, configs, device, lock, [1, 0])
    if all(torch.equal(a, b) for a, b in zip(first.queries_keys, swapped.queries_keys)):
        if all(torch.equal(t[..., 0, :], t[..., 1, :]) for t in first.queries_keys):  # one token at 0 and at 1
            raise UnsupportedModelError(
                f"{name} encodes no position in its queries and keys (every layer without RoPE, e.g. all NoPE or "
                "all full-attention layers of a model that rotates only its sliding ones, or a position bias applied "
                "outside them, such as ALiBi, which hfpaged's attention would drop); hfpaged serves models whose "
                "positions come from the position_ids it passes"
            )
        raise UnsupportedModelError(
            f"{name} ignores the position_ids it is given (its decoder numbers positions itself, from its cache); "
            "hfpaged's packed steps need every token's position from position_ids"
        )
    check_generate_positions(model, device, lock)
    return first.records


def check_generate_positions(model: torch.nn.Module, device: torch.device, lock: threading.RLock) -> None:
    """Refuse a model whose ``generate`` numbers positions otherwise than 0, 1, 2, ... (hfpaged's position_ids).

    ``generate`` passes 0-based position_ids unless the model's ``prepare_inputs_for_generation`` drops them;
    then the model numbers tokens itself (Kosmos-2.5 from its padding id + 1), which two stock forwards, with
    and without position_ids, tell apart. Skipped where that preparation cannot run outside ``generate``.
    """
    input_ids = torch.tensor([[3, 4, 5]], device=device)
    positions = torch.arange(3, device=device)[None]
    try:
        prepared = model.prepare_inputs_for_generation(
            input_ids, attention_mask=torch.ones_like(input_ids), position_ids=positions, use_cache=False
        )
    except Exception:
        return
    if prepared.get("position_ids") is not None:
        return
    with torch.inference_mode(), lock:
        own = model(input_ids=input_ids, use_cache=False).logits
        given = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    if not torch.equal(own, given):
        raise UnsupportedModelError(
            f"{type(model).__name__} numbers positions itself in generate (its prepare_inputs_for_generation drops "
            "position_ids, and its own numbering is not 0, 1, 2, ...); hfpaged's packed steps pass 0-based positions"
        )


def _probe(model, configs, device, lock, positions: list[int]) -> Discovery:
    context = Discovery(queries_keys=[])
    pads = {getattr(cfg, "pad_token_id", None) for cfg in configs}  # a padding id may embed to zeros
    token = next(t for t in range(1, 4) if t not in pads)
    input_ids = torch.full((1, len(positions)), token, dtype=torch.long, device=device)
    name = type(model).__name__
    try:
        with torch.inference_mode(), paged_forward(configs, lock), probing(model):
            position_ids = torch.tensor([positions], device=device)
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False, hfpaged=context)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from None
    except Exception as exc:  # anything the forward runs (the model's code, hooks, weights): the cause is chained
        raise UnsupportedModelError(
            f"{name}'s forward raised {type(exc).__name__}: {exc} during hfpaged's probe forward (a packed forward "
            "through the hfpaged attention implementation that finds the attention layers), so hfpaged cannot patch "
            "it; the exception above says where it was raised (a stock forward that fails too points at the model "
            "or its hooks rather than at hfpaged's packed call)"
        ) from exc
    return context


def window_length_limit(model: torch.nn.Module, layers: list[LayerRecord]) -> tuple[int, str] | None:
    """The longest sequence served exactly when a layer's window is not in its attention call, and why.

    Stock ``generate``'s cache (``DynamicCache(config=...)``) keeps only the last ``sliding_window`` tokens
    of a sliding layer. A model whose attention call passes that window is paged with it; one whose window
    lives only in the mask it builds or in that cache (PhiMoE, Qwen2-MoE's sliding layers, Moshi) would be
    paged without it, which agrees with stock only while no sequence is longer than the window.
    """
    try:
        cache_layers = DynamicCache(config=model.config).layers
    except Exception:  # a cache transformers cannot build from the config: no window to compare with
        return None
    windows = []
    for index, record in enumerate(layers):
        position = getattr(record.module, "layer_idx", index)
        cache_layer = cache_layers[position] if isinstance(position, int) and position < len(cache_layers) else None
        window = getattr(cache_layer, "sliding_window", None)
        if isinstance(window, int) and window != record.sliding_window:
            windows.append((window, position))
    if not windows:
        return None
    window, position = min(windows)
    return window, (
        f"of layer {position}'s sliding window, which transformers' cache keeps but the layer's attention call "
        "does not pass (it lives in a mask or cache hfpaged does not build)"
    )


def window_signature(model: Any) -> tuple:
    """The config fields transformers' cache reads sliding windows from (``window_length_limit``)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None)
    return (
        getattr(cfg, "sliding_window", None), getattr(cfg, "attention_chunk_size", None),
        tuple(layer_types) if isinstance(layer_types, (list, tuple)) else layer_types,
        getattr(cfg, "num_hidden_layers", None), getattr(cfg, "use_sliding_window", None),
    )  # fmt: skip


def refresh_length_limit(model: Any, state: Any) -> None:
    """Follow the config's sliding windows edited since ``patch`` in ``state`` (the ``PatchState``): layers whose
    attention call does not pass the window their cache keeps (Gemma2's copy theirs when built) serve up to it."""
    signature = window_signature(model)
    if signature != state.window_signature:
        state.window_signature = signature
        window = window_length_limit(model, state.layers)
        state.length_limit = min((limit for limit in (state.rope_limit, window) if limit), default=None)


def release_cuda_memory() -> None:
    """Hand cached CUDA memory back to the driver (``sleep``), cuBLAS's per-stream workspaces included (the
    graph-capture stream's too)."""
    if torch.cuda.is_available():
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def max_model_len(model: PreTrainedModel) -> int | None:
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if value else None


# attribute names of the learned absolute position tables of transformers' decoders (GPT-2, GPT-Neo, GPT-BigCode,
# ImageGPT: ``wpe``; OPT, BioGPT: ``embed_positions``, with an ``offset``; BERT-style: ``position_embeddings``)
POSITION_TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings")


def position_table(model: torch.nn.Module) -> tuple[int, str] | None:
    """The positions a learned absolute position table has rows for, and the table's description; None: none found.

    An ``nn.Embedding`` (or subclass) of the language model under one of ``POSITION_TABLE_NAMES``: its rows less its
    ``offset`` (OPT's 2), whatever the config says (a table of other size than ``max_position_embeddings`` still
    ends where its rows do). Stock ``generate`` raises ``IndexError`` when it forwards a token at a position past
    such a table; RoPE models have none. A table under another name is not found (README, Supported models)."""
    try:  # the language model only (a vision tower's position table is not the text's positions)
        decoder = model.get_decoder()
    except Exception:
        decoder = None
    inside = {id(m) for m in (decoder if isinstance(decoder, torch.nn.Module) else model).modules()}
    found = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in POSITION_TABLE_NAMES or not isinstance(module, torch.nn.Embedding):
            continue
        offset = getattr(module, "offset", 0)
        if id(module) in inside and isinstance(offset, int) and module.num_embeddings > offset:
            rows = f"{name}, {module.num_embeddings} rows" + (f", offset {offset}" if offset else "")
            found.append((module.num_embeddings - offset, rows))
    return min(found) if found else None


def block_bytes(
    layers: list[LayerRecord], block_size: int, cache_dtype: torch.dtype | None = None
) -> dict[torch.device, int]:
    """Bytes one block takes on each device (K and V of every layer there; ``cache_dtype`` None: the layer's)."""
    per_device: dict[torch.device, int] = {}
    for layer in layers:
        elem = torch.empty((), dtype=cache_dtype or layer.dtype).element_size()
        size = block_size * layer.num_kv_heads * (layer.head_dim + layer.head_dim_v) * elem
        per_device[layer.device] = per_device.get(layer.device, 0) + size
    return per_device


def size_pool(
    model: torch.nn.Module,
    config: EngineConfig,
    layers: list[LayerRecord],
    configs: list[PretrainedConfig],
    input_device: torch.device,
    model_len: int | None,
    lock: threading.RLock,
    long_rope: LongRope | None = None,
) -> int:
    """The number of blocks: ``config.num_blocks``, or what fits the memory budget (never more than
    ``max_num_seqs`` sequences of ``model_len``, the longest a request may grow). The profile forward runs as a
    step runs (a longrope model's rotary modules as ``long_rope_step`` has them)."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_device = block_bytes(layers, config.block_size, cache_dtype(config.kv_cache_dtype))
    upper = config.max_num_seqs * cdiv(model_len or 4096, config.block_size)
    if not all(layer.device.type == "cuda" for layer in layers):
        budget = int(config.cpu_kv_cache_gib * (1 << 30))
        return max(1, min(upper, budget // sum(per_device.values())))
    return _size_pool_cuda(model, config, configs, input_device, model_len, per_device, upper, lock, long_rope)


def _size_pool_cuda(model, config, configs, input_device, model_len, per_device, upper, lock, long_rope) -> int:
    """Profile one forward at max_num_batched_tokens, give gpu_memory_utilization of memory to the pool."""
    devices = sorted(per_device, key=str)
    for dev in devices:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    num_tokens = config.max_num_batched_tokens
    seq_len = min(num_tokens, model_len or num_tokens)
    positions = torch.arange(num_tokens, device=input_device) % seq_len
    input_ids = torch.zeros(1, num_tokens, dtype=torch.long, device=input_device)
    num_logits = min(config.max_num_seqs, num_tokens)
    kwargs = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = torch.arange(num_tokens - num_logits, num_tokens, device=input_device)
    with torch.inference_mode(), paged_forward(configs, lock), long_rope_step(long_rope):
        model(input_ids=input_ids, position_ids=positions[None], use_cache=False, hfpaged=Discovery(), **kwargs)
    num_blocks = upper
    for dev in devices:
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        reserved = torch.cuda.memory_reserved(dev)
        non_torch = total - free - reserved
        budget = int(total * config.gpu_memory_utilization) - non_torch - peak - CUDA_HEADROOM_BYTES
        if budget <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache on {dev}: {total / 2**30:.1f} GiB total, "
                f"{peak / 2**30:.1f} GiB peak for the model, gpu_memory_utilization={config.gpu_memory_utilization}; "
                "raise gpu_memory_utilization or lower max_num_batched_tokens"
            )
        num_blocks = min(num_blocks, budget // per_device[dev])
    return max(1, int(num_blocks))


def allocate_caches(
    layers: list[LayerRecord], num_blocks: int, block_size: int, cache_dtype: torch.dtype | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V tensor per layer, on the layer's device,
    of ``cache_dtype`` (None: the layer's dtype)."""
    return [
        (
            torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype=dtype, device=layer.device),
            torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim_v, dtype=dtype, device=layer.device),
        )
        for layer, dtype in ((layer, cache_dtype or layer.dtype) for layer in layers)
    ]
