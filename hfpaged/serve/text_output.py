"""One choice's text as its tokens arrive: whole characters only, cut before the first stop string.

Decoding is incremental (``hfpaged.detokenizer``: whole characters only); at the end full decoding has the
last word, so the pieces add up to ``tokenizer.decode(ids)``.

OpenAI leaves the stop string out of the text, while the engine keeps its tokens (as transformers does).
So the text is searched for the stop strings, and while streaming any tail that could still become a stop
string is held back until the next token decides. The engine's stop strings, as stock ``generate``'s, may
begin in the prompt: the search starts in the prompt's last characters (``context``), and the completion is
cut where the stop string's completion part begins (at its start, then).
"""

from __future__ import annotations

from typing import Any

from ..detokenizer import IncrementalDetokenizer


class IncrementalText:
    """Text deltas of one generated sequence, given its growing list of generated ids."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None, context: str = ""):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.context = context[len(context) - self.max_stop_len + 1 :] if self.max_stop_len > 1 else ""
        self.decoder = IncrementalDetokenizer(tokenizer)
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
        text, offset = self.context + self.decoded, len(self.context)  # the prompt's tail, then the completion
        start = max(0, offset + self.num_searched - self.max_stop_len + 1)
        found = []
        for stop in self.stop:  # the first match that reaches into the completion
            pos = text.find(stop, start)
            while pos >= 0 and pos + len(stop) <= offset:
                pos = text.find(stop, pos + 1)
            if pos >= 0:
                found.append(pos)
        self.num_searched = len(self.decoded)
        if found:
            self.decoded = self.decoded[: max(0, min(found) - offset)]
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        for length in range(min(self.max_stop_len - 1, len(self.decoded) - self.num_sent), 0, -1):
            tail = self.decoded[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0
