"""What generate_many and Engine.step hand back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one request gained in one engine step."""

    request_id: str
    index: int | None  # position in the generate_many prompt list, when there is one
    new_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or None while running


@dataclass
class GenerationResult:
    """The outcome of one prompt, in the order the prompts were given."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only, including the eos that stopped it (as generate returns)
    text: str | None  # decoded generated text when a tokenizer is known
    finish_reason: str  # "stop" or "length"
    metrics: dict[str, float] = field(default_factory=dict)
