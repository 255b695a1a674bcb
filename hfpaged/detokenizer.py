"""Incremental detokenization: text for a growing list of token ids, never splitting a character.

A fast tokenizer decodes through its own ``tokenizers.decoders.DecodeStream`` (Rust, about 1 us a token);
any other decodes a short window each call (the previously emitted chunk as context, plus the new tokens),
so the work per token stays O(1). Either holds text back while a multi-byte character's bytes have not all
arrived and releases it once it completes; ``finish`` releases whatever differs from decoding all ids at
once, so the pieces add up to ``tokenizer.decode(ids[start:])``.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the window path only
    DecodeStream = None

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids (``ids[start:]`` of its growing id list) into text pieces."""

    def __init__(self, tokenizer: Any, start: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.start = start
        self.prefix_offset = start  # start of the context window
        self.read_offset = start  # ids before this have been turned into text
        self.emitted: list[str] = []
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if DecodeStream is not None and self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """New text now that ``ids`` has grown; "" while a character is still incomplete."""
        if len(ids) == self.read_offset:
            return ""
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, token_id) for token_id in ids[self.read_offset :]]
            self.read_offset = len(ids)
            delta = "".join(piece for piece in pieces if piece)
            self.emitted.append(delta)
            return delta
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT) or not new_text.startswith(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self.emitted.append(delta)
        return delta

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once no more ids will come (what full decoding adds to the pieces so far)."""
        text = self._decode(ids[self.start :])
        sent = "".join(self.emitted)
        self.read_offset = self.prefix_offset = len(ids)
        if text.startswith(sent):
            rest = text[len(sent) :]
            self.emitted.append(rest)
            return rest
        return ""  # pragma: no cover - a tokenizer whose decoding depends on far context (not seen in practice)
