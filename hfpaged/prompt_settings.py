"""Which settings apply to which prompt: the call's arguments, per-prompt configs and prompt dicts.

A prompt is a string, token ids, or a dict ``{"prompt": ..., "generation_config": GenerationConfig,
**settings}``; ``generation_config=`` may also be a list with one config (or None) per prompt. A prompt's
config replaces the call's; its settings are merged key by key over the call's keyword arguments, which in
turn override fields of the config (as in ``generate``). So to vary a setting per prompt, give it in the
prompt dicts, not in the call. Settings that are not GenerationConfig fields are ``CallOptions``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

# ``generate`` arguments (not GenerationConfig fields) hfpaged does not implement.
_UNSUPPORTED_ARGUMENTS = {
    "assistant_model": "assisted (speculative) decoding",
    "assistant_tokenizer": "assisted (speculative) decoding",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "custom_generate": "custom decoding loops",
    "synced_gpus": "synced multi-GPU generation",
    "attention_mask": "prompts are given unpadded, one list of ids each",
    "inputs_embeds": "prompts must be token ids or strings",
    "past_key_values": "the paged KV cache is managed by hfpaged",
    "input_ids": "pass the prompts as the first argument",
    "inputs": "pass the prompts as the first argument",
}


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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 and isinstance(v, (int, float))
                for k, v in self.logit_bias.items()
            ):
                raise ValueError(f"logit_bias must be a dict of token id (int >= 0) -> float, got {self.logit_bias!r}")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an int >= 0, got {self.top_logprobs!r}")
        if self.top_logprobs:
            self.return_logprobs = True
        if self.logits_processor is not None and not isinstance(self.logits_processor, list):
            raise ValueError("logits_processor must be a LogitsProcessorList (or a list of processors)")
        if self.stopping_criteria is not None and not isinstance(self.stopping_criteria, list):
            raise ValueError("stopping_criteria must be a StoppingCriteriaList (or a list of criteria)")


CALL_OPTION_NAMES = frozenset(f.name for f in fields(CallOptions))


def split_call_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(generate kwargs, CallOptions kwargs)``; raises for ``generate`` arguments hfpaged does not support."""
    for name, what in _UNSUPPORTED_ARGUMENTS.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            raise ValueError(f"generate_many does not support {name}= ({what})")
    generate_kwargs = {k: v for k, v in kwargs.items() if k not in CALL_OPTION_NAMES and k not in _UNSUPPORTED_ARGUMENTS}
    options = {k: v for k, v in kwargs.items() if k in CALL_OPTION_NAMES}
    return generate_kwargs, options


@dataclass
class PromptSpec:
    """One prompt with the settings that apply to it."""

    prompt: Any
    generation_config: GenerationConfig | None
    generate_kwargs: dict[str, Any]
    options: CallOptions
    has_own_settings: bool = False  # its generate kwargs differ from the call's


def expand_prompts(
    prompts: list[Any],
    generation_config: GenerationConfig | list[GenerationConfig | None] | None,
    kwargs: dict[str, Any],
) -> list[PromptSpec]:
    """Pair every prompt with its config, generate kwargs and options (see the module docstring)."""
    if isinstance(generation_config, (list, tuple)):
        if len(generation_config) != len(prompts):
            raise ValueError(
                f"generation_config is a list of {len(generation_config)} configs for {len(prompts)} prompts"
            )
        configs = list(generation_config)
    else:
        configs = [generation_config] * len(prompts)
    call_kwargs, call_options = split_call_options(kwargs)
    base_seed = call_options.get("seed")
    specs = []
    for index, (prompt, config) in enumerate(zip(prompts, configs)):
        own_kwargs: dict[str, Any] = {}
        own_options: dict[str, Any] = {}
        if isinstance(prompt, dict):
            entry = dict(prompt)
            if "prompt" not in entry:
                raise ValueError(f"prompt {index} is a dict without a 'prompt' key")
            prompt = entry.pop("prompt")
            config = entry.pop("generation_config", config)
            own_kwargs, own_options = split_call_options(entry)
        options = {**call_options, **own_options}
        if "seed" not in own_options and base_seed is not None:
            options["seed"] = (base_seed + index) % 2**62
        specs.append(
            PromptSpec(
                prompt=prompt,
                generation_config=config,
                generate_kwargs={**call_kwargs, **own_kwargs},
                options=CallOptions(**options),
                has_own_settings=bool(own_kwargs),
            )
        )
    return specs
