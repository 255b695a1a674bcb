"""Every use of private transformers API, in one place: a transformers upgrade that moves one of these
touches this file only.

Checked against transformers 5.17 and 5.23. What we use, and why:
- ``GenerationMixin._prepare_generation_config`` / ``_prepare_special_tokens`` / ``_prepare_generated_length``
  / ``_get_logits_processor`` / ``_merge_criteria_processor_list``: resolve settings, lengths, processors and
  stopping criteria exactly as ``generate`` does (defaults and precedence cannot drift);
- ``GenerationConfig._eos_token_tensor`` / ``_pad_token_tensor``: the special tokens those helpers resolved;
- the beam-search steps of ``GenerationMixin._beam_search`` (``_get_top_k_continuations`` and friends): so
  beam search is transformers' round for round;
- ``PretrainedConfig._attn_implementation_internal``: switched to hfpaged's attention during a paged forward
  and back, without the public setter's recursion into sub-configs (we switch each config ourselves);
- a rotary module's ``rope_type`` / ``original_max_seq_len`` and its config's ``rope_parameters``: the length
  up to which a ``dynamic`` or ``longrope`` RoPE keeps its short-sequence frequencies;
- ``modeling_rope_utils.dynamic_rope_update`` / ``ROPE_INIT_FUNCTIONS`` and a longrope module's
  ``original_inv_freq`` / ``attention_scaling``: its forward without the per-forward frequency switch, and the two
  frequency sets that switch picks from (``long_rope.py`` picks them per token instead).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.logits_process import LogitsProcessorList, PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteriaList

# --- generation settings -------------------------------------------------------------------------------


def prepare_generation_config(
    model: Any, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> tuple[GenerationConfig, dict[str, Any]]:
    """``generation_config``/``kwargs`` merged over the model's defaults; also the kwargs it did not use."""
    return model._prepare_generation_config(generation_config, **kwargs)


def prepare_special_tokens(model: Any, config: GenerationConfig) -> None:
    """Resolve eos/pad/bos into the config's token tensors (for a batch of one, on the CPU)."""
    model._prepare_special_tokens(config, kwargs_has_attention_mask=False, device="cpu", batch_size=1)


def prepare_generated_length(
    model: Any, config: GenerationConfig, has_default_max_length: bool, has_default_min_length: bool, prompt_len: int
) -> GenerationConfig:
    """``max_length``/``min_length`` for a prompt of ``prompt_len`` tokens, as ``generate`` sets them."""
    return model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=prompt_len,
        inputs_tensor=None,
    )


def validate_generated_length(
    model: Any, config: GenerationConfig, prompt_len: int, has_default_max_length: bool
) -> None:
    """``generate``'s length checks and warnings (e.g. ``min_new_tokens`` beyond ``max_length``)."""
    model._validate_generated_length(config, prompt_len, has_default_max_length)


def logits_processors(
    model: Any,
    config: GenerationConfig,
    prompt_ids: torch.Tensor,
    prefix_allowed_tokens_fn: Callable | None,
    user_processors: LogitsProcessorList,
    device: torch.device | str,
) -> LogitsProcessorList:
    """The processors ``generate`` builds for one prompt (``prompt_ids``: ``[1, prompt_len]``)."""
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=prompt_ids.shape[-1],
        encoder_input_ids=prompt_ids,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=user_processors,
        device=device,
        model_kwargs={},
    )
    if (config.num_beams or 1) == 1:  # each sequence's row runs alone (5.2x groups a prompt's n rows: 1 // n = 0)
        for processor in processors:
            if isinstance(processor, PrefixConstrainedLogitsProcessor):
                processor._num_beams = 1
    return processors


def merge_stopping_criteria(model: Any, defaults: StoppingCriteriaList, user: list) -> StoppingCriteriaList:
    """``generate``'s merge: a criterion the user passes replaces the built-in one of its type."""
    return model._merge_criteria_processor_list(defaults, user)


def eos_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    return config._eos_token_tensor


def pad_token_tensor(config: GenerationConfig) -> torch.Tensor | None:
    return config._pad_token_tensor


# --- beam search -----------------------------------------------------------------------------------------


class BeamSearchSteps:
    """transformers' beam-search steps (``GenerationMixin._beam_search`` internals) of one model, batch size 1."""

    def __init__(self, model: Any):
        self.model = model

    def flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.model._flatten_beam_dim(tensor)

    def unflatten(self, tensor: torch.Tensor, num_beams: int) -> torch.Tensor:
        return self.model._unflatten_beam_dim(tensor, 1, num_beams)

    def top_k_continuations(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # vocab_size: transformers <= 5.17 takes it; later versions read it from the scores (and ignore it)
        return self.model._get_top_k_continuations(batch_size=1, **kwargs)

    def running_beams_for_next_iteration(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.model._get_running_beams_for_next_iteration(**kwargs)

    def update_finished_beams(self, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return self.model._update_finished_beams(**kwargs)

    def check_early_stop_heuristic(self, **kwargs: Any) -> torch.Tensor:
        return self.model._check_early_stop_heuristic(**kwargs)

    def has_unfinished_sequences(self, *args: Any) -> torch.Tensor:
        return self.model._beam_search_has_unfinished_sequences(*args)


# --- attention implementation ----------------------------------------------------------------------------


def get_attn_implementation(config: PretrainedConfig) -> str | None:
    return config._attn_implementation_internal


def set_attn_implementation(config: PretrainedConfig, value: str | None) -> None:
    """Set one config's attention implementation (not its sub-configs: callers switch each one)."""
    config._attn_implementation_internal = value


def module_eager_attention(module: torch.nn.Module) -> Callable | None:
    """The ``eager_attention_forward`` of the modeling file that defines ``module`` (what ``eager`` runs)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


# --- rotary embeddings whose frequencies follow the length of the forward --------------------------------


def rope_length_limit(model: torch.nn.Module, served: tuple[str, ...] = ()) -> tuple[int, str] | None:
    """The longest sequence a packed paged step can serve exactly with the model's RoPE, and why.

    transformers' ``dynamic`` and ``longrope`` rotary embeddings (``@dynamic_rope_update``) choose their
    frequencies once per forward from its largest position. Stock ``generate`` runs one sequence per forward,
    a paged step packs many (the largest position may be another sequence's) and splits prompts into chunks,
    so the two agree only while every sequence stays where the frequencies are the short-sequence ones:
    ``original_max_position_embeddings`` for longrope, ``max_position_embeddings`` for dynamic. None: no such
    rotary embedding. RoPE types in ``served`` are left out (``long_rope.py`` serves longrope past the limit).
    """
    limits: dict[str, int] = {}
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        per_layer_type = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        for layer_type, kind in per_layer_type.items():
            if kind in served:
                continue
            if isinstance(kind, str) and "dynamic" in kind:
                limit = int(module.original_max_seq_len)
            elif kind == "longrope":
                params = module.config.rope_parameters
                limit = int((params if layer_type is None else params[layer_type])["original_max_position_embeddings"])
            else:
                continue
            limits[kind] = min(limit, limits.get(kind, limit))
    if not limits:
        return None
    kinds = " and ".join(repr(kind) for kind in limits)
    return min(limits.values()), (
        f"up to which the model's {kinds} RoPE keeps one set of frequencies (it picks them per forward from the "
        "longest sequence in it, which a packed step shares between sequences)"
    )


@dataclass
class LongRopeParts:
    """What transformers' ``longrope`` rotary forward picks between, once per forward."""

    original: int  # original_max_position_embeddings: a forward whose largest position is >= it goes long
    forward: Callable  # the module's forward without ``@dynamic_rope_update`` (reads self.inv_freq, attention_scaling)
    long_inv_freq: torch.Tensor  # the long set, computed as the decorator computes it

    def rotate(self, module: torch.nn.Module, long: bool, x: torch.Tensor, position_ids: torch.Tensor, *args, **kw):
        """The module's (cos, sin) with one of its two frequency sets, by its own undecorated forward (the module
        itself is left as it is: its forward reads the set from a stand-in)."""
        inv_freq = self.long_inv_freq if long else module.original_inv_freq
        view = types.SimpleNamespace(
            inv_freq=inv_freq, attention_scaling=module.attention_scaling, config=module.config
        )
        return self.forward(view, x, position_ids, *args, **kw)


def _undecorated(forward: Callable) -> Callable | None:
    """The function ``@dynamic_rope_update`` wraps in ``forward`` (through other ``functools.wraps`` layers)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    wrapper_code = dynamic_rope_update(lambda self, x, position_ids: None).__code__
    while forward is not None:
        inner = getattr(forward, "__wrapped__", None)
        if getattr(forward, "__code__", None) is wrapper_code:
            return inner
        forward = inner
    return None


def longrope_parts(module: torch.nn.Module) -> LongRopeParts | None:
    """The parts of a ``longrope`` rotary module (one rope type for all its layers), or None where the module is
    not laid out as transformers 5.17-5.24 lay it out."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if getattr(module, "rope_type", None) != "longrope":
        return None
    forward = _undecorated(type(module).forward)
    short = getattr(module, "original_inv_freq", None)
    params = getattr(getattr(module, "config", None), "rope_parameters", None)
    if forward is None or not isinstance(short, torch.Tensor) or not isinstance(params, dict):
        return None
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or not hasattr(module, "attention_scaling"):
        return None
    # as the decorator computes it for a forward past the original length (on the device the forward runs on)
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, short.device, seq_len=original + 1)
    return LongRopeParts(original, forward, long_inv_freq.to(short.device))


class _CacheOfLength:
    """What ``prepare_inputs_for_generation`` reads of a cache to decide whether to keep it: its length."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def longrope_crossing(model: Any, original: int) -> str | None:
    """What ``generate`` does when a sequence grows past ``original`` tokens (the forward whose input holds
    ``original + 1`` tokens over a cache of ``original``): "keep" (Llama: the cache stays, later tokens go long),
    "recompute" (Phi-3 from transformers 5.20 on: the cache is dropped and the whole sequence computed long),
    "drop" (Phi-3 on transformers 5.17-5.19: the cache is dropped but only the last token is computed, with no
    context at all); None: no clear answer (the preparation fails outside ``generate``, or it also drops a cache
    short of ``original``)."""
    import warnings

    def prepare(num_tokens: int, cached: int) -> tuple[bool, int]:
        input_ids = torch.zeros(1, num_tokens, dtype=torch.long)
        # what generate passes for the new tokens: next_sequence_length from 5.20 on, cache_position before
        new = dict(next_sequence_length=num_tokens - cached, cache_position=torch.arange(cached, num_tokens))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecated cache kwarg's name
            prepared = model.prepare_inputs_for_generation(
                input_ids, past_key_values=_CacheOfLength(cached), use_cache=True, **new
            )
        kept = any(isinstance(prepared.get(key), _CacheOfLength) for key in ("past_key_values", "cache"))
        return kept, prepared["input_ids"].shape[-1]

    try:
        if not prepare(original, original - 1)[0]:
            return None
        kept, num_inputs = prepare(original + 1, original)
    except Exception:
        return None
    if kept:
        return "keep"
    return {original + 1: "recompute", 1: "drop"}.get(num_inputs)
