"""One choice's text as its tokens arrive: whole characters only, cut before the first stop string.

Decoding is incremental: the Rust ``tokenizers.decoders.DecodeStream`` for fast tokenizers (about 1 us a
token), else a short window over the ids (vLLM's prefix/read offsets, two ``decode`` calls a token). Either
holds text back while a character's bytes have not all arrived, and at the end whatever full decoding adds
is released, so the pieces add up to ``tokenizer.decode(ids)``.

OpenAI leaves the stop string out of the text, while the engine keeps its tokens (as transformers does).
So the text is searched for the stop strings, and while streaming any tail that could still become a stop
string is held back until the next token decides.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_REPLACEMENT = "\ufffd"


class _WindowDecoder:
    """New text of a growing id list, decoding a short window of ids each time (any tokenizer)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are text already

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        if len(ids) == self.read_offset:
            return ""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT) or not new_text.startswith(prefix_text):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        return new_text[len(prefix_text) :]


class _StreamDecoder:
    """New text of a growing id list through the fast tokenizer's own ``DecodeStream``."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=True)
        self.num_ids = 0

    def push(self, ids: list[int]) -> str:
        pieces = []
        for token_id in ids[self.num_ids :]:
            piece = self.stream.step(self.backend, token_id)
            if piece:
                pieces.append(piece)
        self.num_ids = len(ids)
        return "".join(pieces)


def _decoder(tokenizer: Any) -> _WindowDecoder | _StreamDecoder:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is not None and backend is not None:
        return _StreamDecoder(backend)
    return _WindowDecoder(tokenizer)


class IncrementalText:
    """Text deltas of one generated sequence, given its growing list of generated ids."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.decoder = _decoder(tokenizer)
        self.decoded = ""  # everything decoded so far (cut at a stop string once one is seen)
        self.num_sent = 0  # characters of ``decoded`` handed out
        self.num_searched = 0  # characters of ``decoded`` searched for stop strings
        self.stopped = False  # a stop string was found: the text ends before it

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return self.decoded[: self.num_sent]

    def push(self, ids: list[int], finished: bool) -> str:
        """The new text now that the generated ids are ``ids``; ``finished``: no more will come."""
        if self.stopped:
            return ""
        if finished:  # full decoding has the last word (and is all a non-streaming request needs)
            full = self.tokenizer.decode(ids, skip_special_tokens=True)
            self.decoded = full if full.startswith(self.decoded) else self.decoded + self.decoder.push(ids)
        else:
            self.decoded += self.decoder.push(ids)
        self._cut_at_stop()
        end = len(self.decoded)
        if not (finished or self.stopped):
            end -= self._stop_prefix_len()
        delta = self.decoded[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return delta

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        start = max(0, self.num_searched - self.max_stop_len + 1)
        found = [pos for pos in (self.decoded.find(s, start) for s in self.stop) if pos >= 0]
        self.num_searched = len(self.decoded)
        if found:
            self.decoded = self.decoded[: min(found)]
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        for length in range(min(self.max_stop_len - 1, len(self.decoded) - self.num_sent), 0, -1):
            tail = self.decoded[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
