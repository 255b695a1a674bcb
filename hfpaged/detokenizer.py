"""Incremental detokenization: text for a growing list of token ids, never splitting a character.

A fast tokenizer decodes through its own ``tokenizers.decoders.DecodeStream`` (Rust, about 1 us a token);
any other decodes a short window each call (the previously emitted chunk as context, plus the new tokens),
so the work per token stays O(1). Either holds text back while a multi-byte character's bytes have not all
arrived and releases it once it completes; ``finish`` releases whatever differs from decoding all ids at
once, so the pieces add up to ``tokenizer.decode(ids[start:])``.

Byte-fallback tokens (sentencepiece's ``<0x0A>``, Llama-2/Mistral) decode as one run: a run that is not valid
UTF-8 becomes one U+FFFD per byte, so a byte's text can change when the next byte arrives ("8" then "\ufffd\ufffd").
A trailing run is therefore held back until a token of another kind ends it (or ``finish``). DecodeStream sees
such a run through its short window (it raises "Invalid prefix" or decodes it differently), so a request that
generates one goes on with the window path.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the window path only
    DecodeStream = None

_REPLACEMENT = "\ufffd"
_byte_ids_cache: Any = weakref.WeakKeyDictionary()  # tokenizer -> {id: byte} of its byte-fallback tokens


def byte_tokens(tokenizer: Any) -> dict[int, int]:
    """The tokenizer's sentencepiece byte-fallback tokens (``<0x00>``..``<0xFF>``): id -> byte; cached per tokenizer."""
    try:
        return _byte_ids_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    found: dict[int, int] = {}
    if hasattr(tokenizer, "convert_tokens_to_ids") and hasattr(tokenizer, "convert_ids_to_tokens"):
        names = [f"<0x{b:02X}>" for b in range(256)]
        try:
            ids = tokenizer.convert_tokens_to_ids(names)
            found = {
                i: b
                for b, (i, name) in enumerate(zip(ids, names))
                if i is not None and tokenizer.convert_ids_to_tokens(i) == name
            }
        except Exception:  # a tokenizer of another kind: no byte tokens to care about
            found = {}
    with contextlib.suppress(TypeError):  # not weak-referenceable or hashable: computed again next time
        _byte_ids_cache[tokenizer] = found
    return found


class IncrementalDetokenizer:
    """Turns one request's generated ids (``ids[start:]`` of its growing id list) into text pieces."""

    def __init__(self, tokenizer: Any, start: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.start = start
        self.prefix_offset = start  # start of the context window
        self.read_offset = start  # ids before this have been turned into text
        self.stream_offset = start  # ids before this have been fed to the DecodeStream
        self.emitted: list[str] = []
        self._byte_ids = byte_tokens(tokenizer)
        # skipped special tokens decode to nothing, so byte tokens on either side of them join one run
        self._invisible = set(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else set()
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if DecodeStream is not None and self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _settled(self, ids: list[int]) -> int:
        """How many ids have text that later ids cannot change: all but a trailing run of byte tokens."""
        if not self._byte_ids:
            return len(ids)
        end = position = len(ids)
        while position > self.read_offset and (
            ids[position - 1] in self._byte_ids or ids[position - 1] in self._invisible
        ):
            position -= 1
            if ids[position] in self._byte_ids:
                end = position
        return end

    def push(self, ids: list[int]) -> str:
        """New text now that ``ids`` has grown; "" while a character is still incomplete."""
        end = self._settled(ids)
        if end <= self.read_offset:
            return ""
        if self._stream is not None:
            delta = self._stream_push(ids, end)
            if delta is not None:
                return delta
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset : end])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT) or not new_text.startswith(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = end
        self.emitted.append(delta)
        return delta

    def _stream_push(self, ids: list[int], end: int) -> str | None:
        """DecodeStream's text for ``ids[:end]``; None once it cannot go on (the window path goes on from what was sent)."""
        if end <= self.stream_offset:
            return ""
        if self._byte_ids and not self._valid_byte_runs(ids[self.stream_offset : end]):
            self._stream = None
            return None
        try:  # skipped special tokens left out: DecodeStream would end a byte run at them, decode() does not
            pieces = [
                None if token_id in self._invisible else self._stream.step(self._backend, token_id)
                for token_id in ids[self.stream_offset : end]
            ]
        except Exception:  # text that decodes differently in context: this call's pieces are dropped
            self._stream = None
            return None
        first, self.stream_offset = self.stream_offset, end
        done = [first + k + 1 for k, piece in enumerate(pieces) if piece is not None]
        if done:  # ids up to the last piece are all in the text (DecodeStream keeps none of them back)
            self.prefix_offset, self.read_offset = self.read_offset, done[-1]
        delta = "".join(piece for piece in pieces if piece)
        self.emitted.append(delta)
        return delta

    def _valid_byte_runs(self, ids: list[int]) -> bool:
        """Whether every run of byte tokens in ``ids`` (whole runs: ``_settled`` ends them) is valid UTF-8."""
        run = bytearray()
        for token_id in ids:
            byte = self._byte_ids.get(token_id)
            if byte is not None:
                run.append(byte)
            elif token_id not in self._invisible and run:
                if not _is_utf8(run):
                    return False
                run.clear()
        return _is_utf8(run)

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once no more ids will come (what full decoding adds to the pieces so far)."""
        text = self._decode(ids[self.start :])
        sent = "".join(self.emitted)
        self.read_offset = self.prefix_offset = self.stream_offset = len(ids)
        if text.startswith(sent):
            rest = text[len(sent) :]
            self.emitted.append(rest)
            return rest
        return ""  # pragma: no cover - a tokenizer whose decoding depends on far context (not seen in practice)


def _is_utf8(data: bytearray) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
