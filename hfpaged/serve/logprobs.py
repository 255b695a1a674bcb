"""Per-token log-probabilities in the two OpenAI shapes (completions' parallel lists, chat's ``content`` list).

A token that is part of a multi-byte character (byte-level BPE, sentencepiece byte fallback) decodes alone to
U+FFFD. As OpenAI does, such a token is named by its own bytes (``"bytes:\\xc3"``) and chat's ``bytes`` field holds
them, so distinct byte tokens stay distinct and a client can rebuild the characters; completions' ``text_offset``
follows the text as it is decoded in context (a character split over tokens sits at the offset where it starts).
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..detokenizer import IncrementalDetokenizer

_FLOOR = -9999.0  # stands for -inf, which JSON cannot carry (vLLM does the same)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte fallback


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


_BYTE_OF = _byte_level_table()


class TokenStrings:
    """Token id -> (name, bytes) for log-probs: the text it decodes to alone, or ``bytes:\\x..`` (cached)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def token_bytes(self, token_id: int) -> bytes:
        return self.entry(token_id)[1]

    def entry(self, token_id: int) -> tuple[str, bytes]:
        found = self.cache.get(token_id)
        if found is None:
            found = self.cache[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id])
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        raw = self._raw_bytes(token_id)
        if raw is None:  # a tokenizer of another kind: its text is all there is
            return text, text.encode("utf-8")
        try:
            return raw.decode("utf-8"), raw  # e.g. a vocabulary entry that is U+FFFD itself
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return None
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return None


class TextOffsets:
    """``text_offset`` of one choice's tokens: where each token's text starts in the choice's text (after ``start``
    characters of echoed prompt), decoded in context as the text itself is."""

    def __init__(self, tokenizer: Any, start: int):
        self.decoder = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.offset = start

    def __call__(self, token_ids: list[int]) -> list[int]:
        out = []
        for token_id in token_ids:
            out.append(self.offset)
            self.ids.append(token_id)
            self.offset += len(self.decoder.push(self.ids))
        return out


def completion_logprobs(
    strings: TokenStrings,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[dict[int, float]] | None,
    offsets: TextOffsets,
    text_end: int | None = None,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of ``/v1/completions``: tokens, token_logprobs, top_logprobs, text_offset.
    ``text_end``: the length of the text handed out (its end when a stop string cut it: the stop string's tokens
    sit there). While streaming, a token whose text is held back (a possible stop string) sits at the end of what
    was sent, so it may come before its place in the whole response's offsets."""
    tops = []
    for top in top_logprobs or [{}] * len(token_ids):
        named: dict[str, float] = {}
        for token_id, logprob in top.items():  # most likely first; names that still collide keep the first
            named.setdefault(strings(token_id), _finite(logprob))
        tops.append(named)
    return {
        "tokens": [strings(t) for t in token_ids],
        "token_logprobs": [_finite(lp) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": [o if text_end is None else min(o, text_end) for o in offsets(token_ids)],
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
            {**_entry(strings, token_id, logprob), "top_logprobs": [_entry(strings, t, lp) for t, lp in top.items()]}
        )
    return {"content": content, "refusal": None}


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    name, raw = strings.entry(token_id)
    return {"token": name, "logprob": _finite(logprob), "bytes": list(raw)}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR
