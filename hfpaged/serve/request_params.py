"""OpenAI request fields -> ``Engine.add_request`` settings (generate-style keyword arguments)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import invalid_request
from .protocol import SamplingRequest

_SEED_MODULUS = 2**62  # the engine's seed range; OpenAI seeds may be any int
_MIN_TEMPERATURE = 1e-5  # below it a request is greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class ModelLimits:
    """What bounds one request: the model's context, the KV pool's capacity and the vocabulary."""

    max_model_len: int | None  # max_position_embeddings; None when the config does not say
    max_pool_tokens: int  # num_blocks * block_size: one sequence can never hold more
    vocab_size: int
    # (P, N): a prompt of at most P tokens may reach N tokens in all (a longrope model whose generate computes
    # tokens past P without context, on transformers < 5.20; hfpaged/model/long_rope.py); None: no such bound
    short_prompts: tuple[int, int] | None = None

    @property
    def max_total_tokens(self) -> int:
        """Prompt + completion tokens one sequence can reach."""
        if self.max_model_len is None:
            return self.max_pool_tokens
        return min(self.max_model_len, self.max_pool_tokens)

    def total_tokens_for(self, prompt_len: int) -> int:
        """Prompt + completion tokens a sequence with a prompt of ``prompt_len`` tokens can reach."""
        if self.short_prompts is not None and prompt_len <= self.short_prompts[0]:
            return min(self.short_prompts[1], self.max_total_tokens)
        return self.max_total_tokens


def stop_strings(request: SamplingRequest) -> list[str]:
    """``stop`` as a list (a single string is one stop string)."""
    stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if any(stop == "" for stop in stops):
        raise invalid_request("`stop` strings must not be empty", param="stop")
    return stops


def completion_budget(
    max_tokens: int | None, prompt_len: int, limits: ModelLimits, *, default: int | None, prompt_param: str
) -> int:
    """``max_new_tokens`` for a prompt of ``prompt_len`` tokens: the request's, else ``default``, else all room left."""
    limit = limits.total_tokens_for(prompt_len)
    what = (
        "context length" if limits.max_model_len is not None and limit == limits.max_model_len else "KV cache capacity"
    )
    if limit < limits.max_total_tokens:
        what = f"length for prompts of at most {limits.short_prompts[0]} tokens"
    if prompt_len >= limit:
        raise invalid_request(
            f"This model's maximum {what} is {limit} tokens. However, your {prompt_param} has {prompt_len} tokens, "
            "which leaves no room for a completion. Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - prompt_len if default is None else min(default, limit - prompt_len)
    if prompt_len + max_tokens > limit:
        raise invalid_request(
            f"This model's maximum {what} is {limit} tokens. However, you requested {prompt_len + max_tokens} "
            f"tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the completion). Please reduce the length "
            "of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def generate_kwargs(request: SamplingRequest, limits: ModelLimits, *, num_logprobs: int | None) -> dict[str, Any]:
    """Sampling settings shared by every prompt and choice of ``request`` (no length, no seed offset).

    OpenAI's defaults apply to what the request leaves out (temperature 1, top_p 1); a temperature below 1e-5
    is greedy, as in vLLM (dividing the logits by one of 1e-45 overflows float32). Settings OpenAI has no
    field for (top_k, repetition_penalty, ...) stay as the model's
    ``generation_config`` says, as in ``generate``.
    """
    kwargs: dict[str, Any] = {}
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature < _MIN_TEMPERATURE:
        kwargs["do_sample"] = False
    else:
        kwargs["do_sample"] = True
        kwargs["temperature"] = temperature
        kwargs["top_p"] = 1.0 if request.top_p is None else request.top_p
    stops = stop_strings(request)
    if stops:
        kwargs["stop_strings"] = stops
    if request.presence_penalty:
        kwargs["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        kwargs["frequency_penalty"] = request.frequency_penalty
    if request.logit_bias:
        kwargs["logit_bias"] = _logit_bias(request.logit_bias, limits.vocab_size)
    if num_logprobs is not None:
        kwargs["return_logprobs"] = True
        kwargs["top_logprobs"] = num_logprobs
    return kwargs


def seed_for(request: SamplingRequest, prompt_index: int) -> int | None:
    """The seed of the request's ``prompt_index``-th prompt: ``seed + prompt_index`` (as ``generate_many``)."""
    if request.seed is None:
        return None
    return (request.seed + prompt_index) % _SEED_MODULUS


def _logit_bias(logit_bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in logit_bias.items():
        if not (key.isascii() and key.isdigit()):  # plain decimal token ids, as OpenAI's (int() takes " 5", "1_0")
            raise invalid_request(f"`logit_bias` keys must be token ids, got {key!r}", param="logit_bias")
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise invalid_request(
                f"`logit_bias` token id {token_id} is outside the vocabulary [0, {vocab_size})", param="logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise invalid_request(f"`logit_bias` values must be in [-100, 100], got {value}", param="logit_bias")
        out[token_id] = float(value)
    return out
