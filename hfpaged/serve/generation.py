"""The choices of one API request, filled in from engine outputs as they arrive.

A request with P prompts and ``n`` choices per prompt has P*n choices, choice ``p*n + j`` being the j-th of
prompt p (OpenAI's order). Sampling runs each prompt as one engine request with
``num_return_sequences=n`` (the n samples share the prompt's blocks); greedy decoding runs n engine
requests per prompt (transformers allows no n > 1 without sampling; the prefix cache shares the prompt).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .engine_client import EngineClient
from .messages import EngineFailure, Submission, TokenDelta
from .protocol import SamplingRequest
from .request_params import seed_for, stop_strings
from .text_output import IncrementalText

# engine finish reasons -> OpenAI's ("time": max_time ran out, reported as a length limit; "error" fails the request)
_FINISH_REASONS = {"stop": "stop", "length": "length", "time": "length", "abort": "abort"}


class RequestClosed(Exception):
    """The request was closed (client gone) while its outputs were awaited."""


@dataclass
class Choice:
    """One returned sequence: its text so far, its token ids and log-probs, and why it ended."""

    index: int
    prompt_index: int
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    num_reported_tokens: int = 0  # tokens already handed out in a ChoiceDelta


@dataclass
class ChoiceDelta:
    """What one choice gained since its previous delta (text, tokens, log-probs), and its end."""

    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class Generation:
    """Submits a request's prompts to the engine and turns their token deltas into per-choice deltas."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: Any,
        request: SamplingRequest,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        generate_kwargs: dict[str, Any],
        *,
        incremental: bool,
    ):
        self.engine = engine
        self.prompts = prompts
        self.incremental = incremental  # decode as tokens arrive (streaming); else once at the end
        self.request_id = uuid.uuid4().hex
        self.created = int(time.time())
        n = request.n
        stops = stop_strings(request)
        longest = max(map(len, stops), default=0)  # a stop string may begin in the prompt's last characters
        tails = [p[-longest:] if longest else [] for p in prompts]  # decoded with the completion, as the engine does
        self.choices = [
            Choice(index=p * n + j, prompt_index=p, text=IncrementalText(tokenizer, stops, tails[p]))
            for p in range(len(prompts))
            for j in range(n)
        ]
        self.by_sequence: dict[tuple[str, int], Choice] = {}  # (submission id, sequence index) -> choice
        self.submissions: list[Submission] = []
        sampled_together = generate_kwargs.get("do_sample") and n > 1
        for p, (prompt, budget) in enumerate(zip(prompts, max_new_tokens)):
            kwargs = {**generate_kwargs, "max_new_tokens": budget}
            seed = seed_for(request, p)
            if seed is not None:
                kwargs["seed"] = seed
            if sampled_together:
                self._submit(f"{self.request_id}-{p}", prompt, {**kwargs, "num_return_sequences": n}, n, p * n)
            else:
                for j in range(n):
                    self._submit(f"{self.request_id}-{p}-{j}", prompt, kwargs, 1, p * n + j)
        self.sink = None
        self.num_unfinished = len(self.choices)

    def _submit(self, request_id: str, prompt: list[int], kwargs: dict, num_sequences: int, first_choice: int) -> None:
        self.submissions.append(Submission(request_id, prompt, kwargs, num_sequences))
        for i in range(num_sequences):
            self.by_sequence[(request_id, i)] = self.choices[first_choice + i]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens, each prompt counted once (however many choices it has)."""
        return sum(len(p) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens generated over all choices."""
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        prompt, completion = self.num_prompt_tokens, self.num_completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def start(self, arrival_time: float) -> None:
        """Hand every prompt to the engine (raises the 400/429/503 ``APIError`` if it is refused)."""
        self.sink = await self.engine.add(self.submissions, arrival_time)

    def close(self) -> None:
        """Abort whatever still runs and wake a reader still waiting for outputs (it gets ``RequestClosed``)."""
        self.engine.abort([s.request_id for s in self.submissions if self.engine.is_active(s.request_id)])
        if self.sink is not None and self.num_unfinished:
            self.sink.put_nowait(RequestClosed())

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Yield each choice's progress until every choice has finished (the last one carries its finish reason).

        Outputs that queued up while the reader was busy are merged, one delta per choice, so a slow reader
        gets fewer, larger chunks instead of falling further behind. Tokens whose text is still held back
        (an incomplete character, a possible stop string) go out with the next delta that has text.
        """
        while self.num_unfinished:
            items = [await self.sink.get()]
            while not self.sink.empty():
                items.append(self.sink.get_nowait())
            texts: dict[int, list[str]] = {}  # choice index -> its new text, in arrival order of choices
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == "error":  # the engine failed this request alone
                    raise EngineFailure(f"the engine failed this request: {item.error or 'unknown error'}")
                choice = self.by_sequence.get((item.prompt_id, item.sequence_index))
                if choice is not None and choice.finish_reason is None:  # else: it ended on a stop string already
                    texts.setdefault(choice.index, []).append(self._advance(choice, item))
            for index, pieces in texts.items():
                choice = self.choices[index]
                text = "".join(pieces)
                if text or choice.finish_reason is not None:
                    yield self._delta(choice, text)

    async def wait(self) -> None:
        """Run every choice to its end (non-streaming)."""
        async for _ in self.deltas():
            pass

    def _advance(self, choice: Choice, output: TokenDelta) -> str:
        """Take one output into its choice; the text it releases."""
        choice.token_ids.extend(output.new_token_ids)
        if output.new_logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs, choice.top_logprobs = [], []
            choice.logprobs.extend(output.new_logprobs)
            choice.top_logprobs.extend(output.new_top_logprobs or [{}] * len(output.new_logprobs))
        finished = output.finished
        text = ""
        # with stop strings a non-streaming choice is decoded as it goes too: the text's stop (searched with special
        # tokens skipped, where the engine's token-level criteria may see none) then ends both kinds alike
        if self.incremental or finished or choice.text.stop:
            text = choice.text.push(choice.token_ids, finished)
            finished = finished or choice.text.stopped
        if finished:
            choice.finish_reason = "stop" if choice.text.stopped else _FINISH_REASONS.get(output.finish_reason, "stop")
            self.num_unfinished -= 1
        return text

    def _delta(self, choice: Choice, text: str) -> ChoiceDelta:
        start, choice.num_reported_tokens = choice.num_reported_tokens, len(choice.token_ids)
        return ChoiceDelta(
            choice=choice,
            text=text,
            token_ids=choice.token_ids[start:],
            logprobs=None if choice.logprobs is None else choice.logprobs[start:],
            top_logprobs=None if choice.top_logprobs is None else choice.top_logprobs[start:],
            finish_reason=choice.finish_reason,
        )
