"""Per-token log-probabilities in the two OpenAI shapes (completions' parallel lists, chat's ``content`` list)."""

from __future__ import annotations

import math
from typing import Any

_FLOOR = -9999.0  # stands for -inf, which JSON cannot carry (vLLM does the same)


class TokenStrings:
    """Token id -> the text it decodes to alone (cached: the same ids come back again and again)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def completion_logprobs(
    strings: TokenStrings,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[dict[int, float]] | None,
    text_offset: int,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of ``/v1/completions``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [strings(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp) for lp in logprobs],
        "top_logprobs": [
            {strings(t): _finite(lp) for t, lp in top.items()} for top in top_logprobs or [{}] * len(tokens)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(
    strings: TokenStrings,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[dict[int, float]] | None,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of ``/v1/chat/completions``: ``{"content": [...], "refusal": None}``."""
    content = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        top = top_logprobs[position] if top_logprobs else {}
        content.append(
            {**_entry(strings(token_id), logprob), "top_logprobs": [_entry(strings(t), lp) for t, lp in top.items()]}
        )
    return {"content": content, "refusal": None}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR
