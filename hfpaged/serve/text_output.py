"""One choice's text as its tokens arrive: whole characters only, cut before the first stop string.

Decoding is incremental (``hfpaged.detokenizer``: whole characters only); at the end full decoding has the
last word, so the pieces add up to ``tokenizer.decode(ids)``.

OpenAI leaves the stop string out of the text, while the engine keeps its tokens (as transformers does).
So the text is searched for the stop strings, and while streaming any tail that could still become a stop
string is held back until the next token decides. The engine's stop strings, as stock ``generate``'s, may
begin in the prompt: the search starts in the prompt's last tokens (``context_ids``), and the completion is
cut where the stop string's completion part begins (at its start, then). Held-back text counts the prompt's
tail too, so what a stop string that begins in the prompt would cut is never sent.

The search sees the completion as it decodes after the prompt, as the engine's stop check does: a decoder that
strips the text's first space (SentencePiece's ``Strip``) drops it from the completion decoded alone, which is
the text returned, but not after the prompt, so a stop string " wor" matches a first token "▁wor". That
difference (``lead``) sits between the prompt's tail and the completion's text in the search.
"""

from __future__ import annotations

from typing import Any

from ..detokenizer import IncrementalDetokenizer


class IncrementalText:
    """Text deltas of one generated sequence, given its growing list of generated ids."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None, context_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.first_chars = {s[0] for s in self.stop if s}
        self.context_ids = list(context_ids or []) if self.stop else []
        self.context = self._decode(self.context_ids) if self.context_ids else ""  # the prompt's tail
        self.lead = ""  # the completion's text after the prompt that it lacks decoded alone
        self.lead_known = not self.context_ids  # set once the completion has text
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
            full = self._decode(ids)
            self.decoded = full if full.startswith(self.decoded) else self.decoded + self.decoder.push(ids)
        else:
            self.decoded += self.decoder.push(ids)
        if not self.lead_known and ids:
            self.lead, self.lead_known = self._lead(ids), bool(self.decoded)
        self._cut_at_stop()
        end = len(self.decoded)
        if not (finished or self.stopped):
            end = self._hold_start()
        delta = self.decoded[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _lead(self, ids: list[int]) -> str:
        """What the completion's text starts with after the prompt's tail but not alone ("" for most decoders)."""
        rest, alone = self._decode(self.context_ids + ids), self._decode(ids)
        if not rest.startswith(self.context):
            return ""  # the prompt's tail decodes differently in context (a character split with the completion)
        rest = rest[len(self.context) :]
        return rest[: len(rest) - len(alone)] if rest.endswith(alone) else ""

    def _cut_at_stop(self) -> None:
        if not self.stop:
            return
        # the prompt's tail, then the completion (its lead first): a match reaching past the tail cuts the completion
        head = self.context + self.lead
        text, offset = head + self.decoded, len(head)
        start = max(0, offset + self.num_searched - self.max_stop_len + 1)
        found = []
        for stop in self.stop:  # the first match that reaches into the completion
            pos = text.find(stop, start)
            while pos >= 0 and pos + len(stop) <= len(self.context):
                pos = text.find(stop, pos + 1)
            if pos >= 0:
                found.append(pos)
        self.num_searched = len(self.decoded)
        if found:
            self.decoded = self.decoded[: max(0, min(found) - offset)]
            self.stopped = True

    def _hold_start(self) -> int:
        """Where the text that could still become part of a stop string begins: the start of the longest tail of
        prompt tail + completion that begins a stop string (the whole completion for one that begins in the prompt)."""
        if not self.stop:
            return len(self.decoded)
        head = self.context + self.lead
        text, offset = head + self.decoded, len(head)
        # text sent is never the start of one (it was not held back), so a tail starts after it or, before any, anywhere
        first = max(len(text) - self.max_stop_len + 1, offset + self.num_sent if self.num_sent else 0)
        for pos in range(first, len(text)):
            tail = text[pos:]
            if text[pos] in self.first_chars and any(s.startswith(tail) for s in self.stop):
                return max(0, pos - offset)
        return len(self.decoded)
