"""hfpaged's entry point in transformers' attention interface, and the per-step data it reads.

During a paged forward the model's configs name ``"hfpaged"`` as their attention implementation (see
``paged_forward``), so every attention layer calls ``paged_attention_forward``. The step's context reaches
it as a forward keyword, ``hfpaged=PagedStep(...)`` (transformers passes extra forward kwargs down to the
attention function): nothing is global, so two models in two threads are independent. The probe forward
of ``patch`` passes ``hfpaged=Discovery()`` instead and records each layer's shapes.

A paged forward holds the model's forward lock, which stock calls of the model take too (``patch`` wraps
``model.forward``), so a stock ``forward``/``generate`` in another thread never sees the switched configs.
Only a call that bypasses the model's own forward (a submodule called directly from another thread while a
step runs) can arrive here without a context: it runs the model's original attention function, though
without a mask (``"hfpaged"`` has no mask function, so that packed paged forwards build none): right for
unpadded batches under sdpa-style attention, not for padded or eager ones.
"""

from __future__ import annotations

import math
import operator
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..kernels._checks import SINK_DTYPES
from . import hf_compat
from .kv_quant import calibrate

ATTENTION_NAME = "hfpaged"


class UnsupportedModelError(TypeError):
    """The model's attention cannot be paged by hfpaged."""


@dataclass
class AttentionMetadata:
    """Per-step tensors every layer reads (all on one device)."""

    slot_mapping: torch.Tensor  # int32 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    _by_device: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> AttentionMetadata:
        """This metadata on ``device`` (layers spread over several devices each read their own copy)."""
        if self.slot_mapping.device == device:
            return self
        cached = self._by_device.get(device)
        if cached is None:
            cached = AttentionMetadata(
                self.slot_mapping.to(device),
                self.block_tables.to(device),
                self.seq_lens.to(device),
                self.cu_seqlens_q.to(device),
                self.max_seqlen_q,
                self.max_seqlen_k,
            )
            self._by_device[device] = cached
        return cached


@dataclass
class LayerRecord:
    """What discovery learned about one attention module."""

    module: torch.nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None
    softcap: float | None
    sinks_dtype: torch.dtype | None = None  # the dtype of the attention sinks the module passes (``s_aux``), if any


@dataclass
class Discovery:
    """The probe forward's context: every attention call is recorded (and answered with zeros)."""

    records: list[LayerRecord] = field(default_factory=list)
    queries_keys: list[torch.Tensor] | None = None  # a list: each call's query and key are kept here too


@dataclass
class PagedStep:
    """A paged forward's context: the step's metadata and the attention function (which stores the step's K/V too)."""

    metadata: AttentionMetadata
    attention_fn: Callable[..., torch.Tensor]
    calibrate: bool = False  # fp8 caches: set each layer's K/V scales from this forward's keys/values first


# --- switching a model's attention for one forward ---------------------------------------------------

_saved_implementations: dict[int, str | None] = {}  # config id -> its implementation while switched


@contextmanager
def paged_forward(configs: list, forward_lock: threading.RLock) -> Iterator[None]:
    """Route the attention of the model owning ``configs`` to hfpaged for one forward on this thread.

    Holds the model's forward lock throughout (stock forwards wait for it), and always switches back.
    """
    with forward_lock, no_autocast():
        saved = [hf_compat.get_attn_implementation(cfg) for cfg in configs]
        for cfg, value in zip(configs, saved):
            _saved_implementations[id(cfg)] = value
            hf_compat.set_attn_implementation(cfg, ATTENTION_NAME)
        try:
            yield
        finally:
            for cfg, value in zip(configs, saved):
                hf_compat.set_attn_implementation(cfg, value)
                _saved_implementations.pop(id(cfg), None)


@contextmanager
def no_autocast() -> Iterator[None]:
    """``torch.autocast`` off for a paged forward or step: the engine's steps are shared by every caller, so one
    caller's autocast must not decide another's numbers (nor patch's probes the pool's dtype); they run in the
    model's own dtype."""
    with ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def check_attention_implementation(configs: list) -> None:
    """Refuse an attention function registered outside transformers (``AttentionInterface.register``): the paged
    kernels compute standard softmax attention, and whether the user's function does cannot be told; and
    transformers' own paged implementations ("paged|..."), which do not attend causally in a plain forward."""
    for cfg in configs:
        name = hf_compat.get_attn_implementation(cfg)
        if isinstance(name, str) and name.startswith("paged"):
            raise ValueError(
                f"the model's attention implementation {name!r} is transformers' own paged attention, made for its "
                "continuous batching (generate_batch): in a plain forward, as stock generate runs it, it does not "
                "attend causally, so hfpaged's causal attention would give other tokens than the model's stock "
                "generate. Load the model with attn_implementation='sdpa' or 'eager' (or "
                "model.set_attn_implementation('sdpa')): hfpaged pages the KV cache itself"
            )
        function = None if name in (None, "eager", ATTENTION_NAME) else ALL_ATTENTION_FUNCTIONS.get(name)
        if function is not None and not getattr(function, "__module__", "").startswith("transformers."):
            raise ValueError(
                f"the model's attention implementation {name!r} is a function registered outside transformers "
                f"({getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', '?')}): hfpaged runs "
                "standard softmax attention in its place and cannot tell whether yours computes the same. Select a "
                "built-in one (model.set_attn_implementation('sdpa'), 'eager', ...) or unpatch the model"
            )


def warn_if_autocast() -> None:
    """A call made under ``torch.autocast`` is told that its steps run in the model's dtype all the same."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        warnings.warn(
            "hfpaged ignores torch.autocast: the engine's steps are shared by every caller and run in the model's "
            "own dtype (stock generate under autocast computes in the autocast dtype instead). To generate in "
            "bfloat16, cast the model, e.g. model.to(torch.bfloat16), before hfpaged.patch",
            stacklevel=4,
        )


_TRAINING = operator.attrgetter("training")


@contextmanager
def eval_mode(model: torch.nn.Module, submodules: Sequence[torch.nn.Module] = ()) -> Iterator[None]:
    """Generation runs in eval semantics (no dropout) even under ``model.train()``; the modes are restored.
    ``submodules``: the model's (the weights check keeps the list): one in training mode under a model in eval mode
    switches everything too (PEFT builds a new adapter's dropout modules so under an eval model; ~20 ns each).

    Called inside the forward lock, so no stock forward (a training step) runs while the modes are switched.
    """
    if not model.training and not any(map(_TRAINING, submodules)):
        yield
        return
    modes = [(module, module.training) for module in model.modules()]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _original_implementation(config: Any) -> str | None:
    if id(config) not in _saved_implementations:
        raise RuntimeError(
            "the hfpaged attention implementation was called outside a paged forward; "
            "hfpaged switches a model's attention only for the duration of its own steps"
        )
    return _saved_implementations[id(config)]


_probing = threading.local()  # .model: set while patch's probe forward runs on this thread


@contextmanager
def probing(model: torch.nn.Module) -> Iterator[None]:
    """Mark this thread as running ``model``'s probe forward: an attention call reaching hfpaged without
    the probe's context then means a layer dropped the forward's keyword arguments (refused)."""
    _probing.model = model
    try:
        yield
    finally:
        _probing.model = None


# --- the attention function -----------------------------------------------------------------------------


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: q/k/v ``[1, heads, T, D]`` packed -> ``[1, T, heads, D]``."""
    context = kwargs.get("hfpaged")
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    sinks = kwargs.get("s_aux")  # attention sinks (GPT-OSS and others): checked at patch (check_attention_call)
    if isinstance(context, PagedStep):
        return _paged(context, module, query, key, value, scaling, sliding_window, softcap, sinks), None
    if isinstance(context, Discovery):
        check_attention_call(module, attention_mask, kwargs, query.shape[1])
        return _discover(context, module, query, key, value, sliding_window, softcap, sinks), None
    if "hfpaged_block_tables" in kwargs:  # compiled decode: the metadata came as forward kwargs
        from .custom_ops import compiled_attention

        return compiled_attention(module, query, key, value, scaling, sliding_window, softcap, sinks, kwargs), None
    if getattr(_probing, "model", None) is not None:
        raise UnsupportedModelError(
            f"attention module {type(module).__name__} was called without hfpaged's step context: a decoder layer "
            "of the model does not pass its forward keyword arguments down to its attention"
        )
    original = _original_implementation(module.config)
    function = ALL_ATTENTION_FUNCTIONS.get_interface(original, hf_compat.module_eager_attention(module))
    return function(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        **kwargs,
    )


def _paged(context: PagedStep, module, query, key, value, scaling, sliding_window, softcap, sinks) -> torch.Tensor:
    if query.shape[0] != 1:
        raise ValueError(f"hfpaged expects a packed batch of shape [1, T], got batch size {query.shape[0]}")
    k_cache, v_cache = module._hfpaged_kv
    meta = context.metadata.on(query.device)
    q, key, value = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    scales = module.__dict__.get("_hfpaged_kv_scale")  # fp8 caches: (whole [2], k_scale, v_scale)
    options = {} if sinks is None else {"sinks": sinks}
    if scales is not None:
        if context.calibrate:
            calibrate(scales[0], key, value, k_cache.dtype)
        options.update(k_scale=scales[1], v_scale=scales[2])
    out = context.attention_fn(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        key=key,  # stored at the slots first; prompt chunks then read them instead of gathering what was stored
        value=value,
        slot_mapping=meta.slot_mapping,
        **options,
    )
    return out.unsqueeze(0)


# Keywords an attention call may carry that change nothing the paged attention computes: the step's context,
# positions the model already applied, and flags of transformers' own implementations.
_NEUTRAL_KWARGS = frozenset(
    {"hfpaged", "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states"}
    | {"return_dict", "deterministic", "is_causal", "logits_to_keep"}
)


def check_attention_call(module: torch.nn.Module, attention_mask: Any, kwargs: dict, num_heads: int) -> None:
    """Refuse (at ``patch``) an attention call that asks for more than causal, windowed, softcapped attention with
    optional sinks (``s_aux``: one floating-point logit per query head, as GPT-OSS passes them).

    Anything else the model passes (sinks of another shape, position biases, sparse-attention indices,
    packed-sequence boundaries), a non-causal module and a mask the model built itself (chunked or bidirectional
    attention) would be ignored by the paged kernels: wrong tokens, so the model is refused.
    """
    name = type(module).__name__
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        if not (isinstance(sinks, torch.Tensor) and sinks.dtype in SINK_DTYPES and tuple(sinks.shape) == (num_heads,)):
            kind = (
                f"of shape {tuple(sinks.shape)} and dtype {str(sinks.dtype).removeprefix('torch.')}"
                if isinstance(sinks, torch.Tensor)
                else f"as a {type(sinks).__name__}"
            )
            raise UnsupportedModelError(
                f"{name} passes attention sinks (s_aux) {kind}; hfpaged's kernels take one floating-point logit per "
                f"query head ({num_heads} here)"
            )
        kwargs = {key: value for key, value in kwargs.items() if key != "s_aux"}
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise UnsupportedModelError(
            f"{name} runs non-causal attention (is_causal=False); hfpaged pages causal attention only"
        )
    extra = sorted(
        key
        for key, value in kwargs.items()
        if value is not None and value is not False and key not in _NEUTRAL_KWARGS and not key.startswith("hfpaged_")
    )
    if extra:
        raise UnsupportedModelError(
            f"{name} passes {', '.join(extra)} to its attention function (attention sinks, position biases or sparse "
            "indices, for example), which hfpaged's paged attention does not implement"
        )
    if attention_mask is not None:
        raise UnsupportedModelError(
            f"{name} attends through a mask its model builds itself (chunked or bidirectional attention, for example); "
            "hfpaged's paged attention implements causal attention with an optional sliding window only"
        )


def _discover(context: Discovery, module, query, key, value, sliding_window, softcap, sinks) -> torch.Tensor:
    if any(record.module is module for record in context.records):
        raise UnsupportedModelError(
            f"attention module {type(module).__name__} ran twice in one forward; "
            "hfpaged needs one KV cache per attention call"
        )
    if context.queries_keys is not None:
        context.queries_keys += [query.clone(), key.clone()]
    context.records.append(
        LayerRecord(
            module=module,
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=key.shape[-1],
            head_dim_v=value.shape[-1],
            dtype=key.dtype,
            device=key.device,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks_dtype=None if sinks is None else sinks.dtype,
        )
    )
    batch, num_heads, seq_len, _ = query.shape
    return query.new_zeros(batch, seq_len, num_heads, value.shape[-1])


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
