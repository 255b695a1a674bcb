"""Per-request generation settings, resolved exactly the way ``model.generate`` resolves them.

We reuse transformers' own helpers (``_prepare_generation_config``, ``_prepare_generated_length``,
``_get_logits_processor``, ``_merge_criteria_processor_list``) so defaults, precedence and processor order
cannot drift from stock ``generate``. Which settings apply to which prompt is ``prompt_settings``' job.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..core.config import is_finite_number, is_real
from ..model import hf_compat
from .processors import Stage, adjustment_stages, plan_stages, stage_schedule, wrap_prefix_allowed_tokens_fn
from .stopping import StopRules, StopStringCache, build_stop_rules

# Generation settings that change the decoding algorithm in ways hfpaged does not implement.
_UNSUPPORTED_WHEN_SET = {
    "constraints": "constrained beam search",
    "force_words_ids": "constrained beam search",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "prompt_lookup_num_tokens": "prompt-lookup (assisted) decoding",
    "assistant_early_exit": "self-speculative decoding",
    "token_healing": "token healing",
    "use_mtp": "multi-token-prediction (assisted) decoding",
}
_UNSUPPORTED_TRUE = {
    "output_scores": "use return_logprobs=True instead",
    "output_logits": "use return_logprobs=True instead",
    "output_attentions": "attentions are not returned by generate_many",
    "output_hidden_states": "hidden states are not returned by generate_many",
    "return_dict_in_generate": "generate_many returns GenerationResult objects (token ids, text, log-probs)",
}


def prompt_name(index: int | None) -> str:
    """How errors name a prompt: its place in the caller's list, when it has one."""
    return "the prompt" if index is None else f"prompt {index}"


def _python_number(value: Any) -> Any:
    """A numpy or 0-d torch real as the Python number it holds (``generate`` takes them; transformers' warpers test
    ``isinstance(value, float)``, and a ``uint8`` length plus a prompt's would wrap); anything else as it is."""
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and is_real(value):
        return value.item()
    return value


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: object) -> bool:
    return is_int(value) and value >= 0


@dataclass
class CallOptions:
    """Per-request options that are not GenerationConfig fields (vLLM-style extras included)."""

    seed: int | None = None  # sampling seed; None draws one from torch's global RNG
    logits_processor: LogitsProcessorList | None = None  # applied with this request's own ids
    stopping_criteria: StoppingCriteriaList | None = None
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None  # batch_id = prompt index
    presence_penalty: float = 0.0  # subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit
    return_logprobs: bool = False  # GenerationResult.logprobs: log-prob of each generated token
    top_logprobs: int = 0  # also the top-k alternatives per position (implies return_logprobs)

    def __post_init__(self) -> None:
        if self.seed is not None and not (is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be an int of 64 bits (-2**63 <= seed < 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(_is_token_id(k) and is_finite_number(v) for k, v in self.logit_bias.items())
        ):
            raise ValueError(
                f"logit_bias must be a dict of token id (int >= 0) -> finite float, got {self.logit_bias!r}"
            )
        if not is_int(self.top_logprobs) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        if self.top_logprobs:
            self.return_logprobs = True
        if self.logits_processor is not None and not isinstance(self.logits_processor, list):
            raise ValueError("logits_processor must be a LogitsProcessorList (or a list of processors)")
        if self.stopping_criteria is not None and not isinstance(self.stopping_criteria, list):
            raise ValueError("stopping_criteria must be a StoppingCriteriaList (or a list of criteria)")


@dataclass
class ResolvedConfig:
    """A GenerationConfig merged over the model's defaults, before per-prompt lengths."""

    generation_config: GenerationConfig
    has_default_max_length: bool
    has_default_min_length: bool


@dataclass
class RequestParams:
    """Everything the engine needs to decode one request."""

    generation_config: GenerationConfig  # this request's copy (max_length/min_length set)
    max_length: int  # prompt + generated tokens at most
    eos_token_ids: frozenset[int]
    do_sample: bool
    seed: int
    stages: tuple[Stage, ...] = ()  # logits processors in transformers' order (see logits_pipeline)
    stop: StopRules = field(default_factory=StopRules)  # stop strings, max_time, user criteria
    return_logprobs: bool = False
    top_logprobs: int = 0
    num_return_sequences: int = 1  # sequences returned for the prompt (parallel samples, or the best beams)
    num_beams: int = 1
    beam_processors: LogitsProcessorList | None = None  # beam search: generate's processors, run as generate runs them

    def __post_init__(self) -> None:
        self.stage_schedule = stage_schedule(self.stages)  # how run_stages orders and groups them
        # whether a stage looks at the tokens so far: then sampling waits for the previous step's tokens
        self.stages_read_history = any(getattr(stage.kind, "reads_history", True) for stage in self.stages)


def resolve_generation_config(
    model: Any, generation_config: GenerationConfig | None, gen_kwargs: dict[str, Any]
) -> ResolvedConfig:
    """Merge ``generation_config``/``gen_kwargs`` over ``model.generation_config`` as ``generate`` does."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
        )
    has_default_max_length = (
        gen_kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    has_default_min_length = (
        gen_kwargs.get("min_length") is None
        and (generation_config is None or generation_config.min_length is None)
        and model.generation_config.min_length is None
    )
    config, unused = hf_compat.prepare_generation_config(model, generation_config, gen_kwargs)
    unused = {k: v for k, v in unused.items() if k not in ("output_attentions", "output_hidden_states")}
    if unused:
        raise ValueError(f"generate_many got unsupported arguments: {sorted(unused)}")
    _check_supported(config)
    try:
        config.validate(strict=False)
    except TypeError:  # older signature
        config.validate()
    hf_compat.prepare_special_tokens(model, config)
    return ResolvedConfig(config, has_default_max_length, has_default_min_length)


def _check_supported(config: GenerationConfig) -> None:
    for name, value in list(vars(config).items()):  # (the config is the request's own copy)
        number = _python_number(value)
        if number is not value and not name.startswith("_"):  # (not transformers' own tensors)
            setattr(config, name, number)
    for name, what in _UNSUPPORTED_WHEN_SET.items():
        value = getattr(config, name, None)
        if value not in (None, False, 0):
            raise ValueError(f"generate_many does not support {name}={value!r} ({what})")
    for name, hint in _UNSUPPORTED_TRUE.items():
        # the output_* flags act only with return_dict_in_generate (stock ignores them otherwise: a checkpoint's
        # generation_config may carry them)
        if getattr(config, name, None) and (name == "return_dict_in_generate" or config.return_dict_in_generate):
            raise ValueError(f"generate_many does not support {name}=True ({hint})")
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise ValueError(
            f"generate_many does not support guidance_scale={config.guidance_scale} (classifier-free guidance)"
        )
    if getattr(config, "cache_implementation", None) == "quantized":  # stock's numbers differ from the pool's
        raise ValueError("generate_many does not support cache_implementation='quantized' (use patch's kv_cache_dtype)")
    if config.num_beam_groups is not None and config.num_beam_groups > 1:
        raise ValueError(f"generate_many does not support num_beam_groups={config.num_beam_groups} (group beam search)")
    if config.num_beams is not None and config.num_beams > 1 and config.low_memory:
        raise ValueError("generate_many does not support low_memory=True with beam search (nor does generate)")
    if config.do_sample:
        if config.temperature is not None and not (is_finite_number(config.temperature) and config.temperature > 0):
            raise ValueError(
                f"temperature must be a number > 0 when do_sample=True, got {config.temperature!r} "
                "(for greedy decoding set do_sample=False)"
            )
        # top_p 0 keeps the top token only, as transformers' TopPLogitsWarper does (it accepts [0, 1])
        if config.top_p is not None and not (is_finite_number(config.top_p) and 0.0 <= config.top_p <= 1.0):
            raise ValueError(f"top_p must be in [0, 1], got {config.top_p!r}")
        if config.top_k is not None and (not isinstance(config.top_k, int) or config.top_k < 0):
            raise ValueError(f"top_k must be a non-negative int, got {config.top_k!r}")
        if config.min_p is not None and not (is_finite_number(config.min_p) and 0.0 <= config.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {config.min_p!r}")
    for name in ("max_new_tokens", "max_length", "max_time"):  # (numpy and 0-d torch numbers, as generate takes)
        value = getattr(config, name)
        if value is None:
            continue
        if name == "max_time" and not is_real(value):
            raise ValueError(f"max_time must be a number of seconds, got {value!r}")
        if name != "max_time" and not (is_finite_number(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0 (tokens), got {value!r}")
    for name in ("num_return_sequences", "num_beams"):
        value = getattr(config, name, None)
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, name, None)
        if value is not None and not _is_token_ids(value, allow_list=name == "eos_token_id"):
            kind = "an int or a list of ints" if name == "eos_token_id" else "an int"
            raise ValueError(f"{name} must be {kind} (token ids), got {value!r}")


def _is_token_ids(value: object, allow_list: bool) -> bool:
    if isinstance(value, torch.Tensor):  # generate takes tensors too
        return not value.is_floating_point() and not value.is_complex() and (allow_list or value.numel() == 1)
    if isinstance(value, np.ndarray):  # and numpy's integers
        return np.issubdtype(value.dtype, np.integer) and (allow_list or value.size == 1)
    if is_int(value) or isinstance(value, np.integer):
        return True
    return (
        allow_list and isinstance(value, (list, tuple)) and all(is_int(v) or isinstance(v, np.integer) for v in value)
    )


def make_request_params(
    model: Any,
    resolved: ResolvedConfig,
    prompt_token_ids: list[int],
    options: CallOptions,
    *,
    seed: int,
    index: int | None,
    vocab_size: int,
    tokenizer: Any = None,
    stop_string_cache: StopStringCache | None = None,
    device: torch.device | str = "cpu",
) -> RequestParams:
    """Per-prompt settings: lengths as ``generate`` computes them, and the processors it would build.

    ``device`` is where beam search runs its processors (the model's input device, as in ``generate``).
    """
    config = copy.copy(resolved.generation_config)
    prompt_len = len(prompt_token_ids)
    config = hf_compat.prepare_generated_length(
        model, config, resolved.has_default_max_length, resolved.has_default_min_length, prompt_len
    )
    if prompt_len >= config.max_length:
        raise ValueError(
            f"{prompt_name(index)} has {prompt_len} tokens but max_length is {config.max_length} "
            "(as in generate, this is an error); set max_new_tokens or a larger max_length"
        )
    if options.logit_bias:
        invalid = [t for t in options.logit_bias if t >= vocab_size]
        if invalid:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {vocab_size}): {invalid}")
    for name in ("forced_bos_token_id", "forced_eos_token_id"):  # stock raises IndexError only when it applies them
        value = getattr(config, name, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        if value is not None and any(isinstance(i, int) and not 0 <= i < vocab_size for i in ids):
            raise ValueError(f"{prompt_name(index)}: {name}={value!r} is outside the vocabulary [0, {vocab_size})")
    num_beams = config.num_beams or 1
    if num_beams > 1:
        _check_beam_options(options)
    processor_device = device if num_beams > 1 else "cpu"  # single-beam processors become stages (logits_pipeline)
    user_processors = LogitsProcessorList(options.logits_processor or [])
    prefix_fn = options.prefix_allowed_tokens_fn
    processors = hf_compat.logits_processors(
        model,
        config,
        torch.tensor([prompt_token_ids], dtype=torch.long, device=processor_device),
        None if prefix_fn is None else wrap_prefix_allowed_tokens_fn(prefix_fn, index or 0),
        user_processors,
        processor_device,
    )
    stages = ()
    if num_beams == 1:
        stages = plan_stages(
            processors,
            user_processors=user_processors,
            adjustments=adjustment_stages(options.presence_penalty, options.frequency_penalty, options.logit_bias),
            vocab_size=vocab_size,
        )
    stop = build_stop_rules(
        model,
        config,
        options.stopping_criteria,
        tokenizer,
        stop_string_cache if stop_string_cache is not None else StopStringCache(),
    )
    return RequestParams(
        generation_config=config,
        max_length=stop.max_length,
        eos_token_ids=stop.eos_token_ids,
        do_sample=bool(config.do_sample),
        seed=seed,
        stages=stages,
        stop=stop,
        return_logprobs=options.return_logprobs,
        top_logprobs=options.top_logprobs,
        num_return_sequences=config.num_return_sequences or 1,
        num_beams=num_beams,
        beam_processors=processors if num_beams > 1 else None,
    )


def _check_beam_options(options: CallOptions) -> None:
    """hfpaged's extras that beam search does not implement (each sequence carries its beam score instead)."""
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "return_logprobs"):
        if getattr(options, name):
            raise ValueError(f"generate_many does not support {name} with num_beams > 1 (beam search)")
