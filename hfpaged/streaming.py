"""Streaming: ``stream_many`` yields tokens as they are sampled; ``astream_many`` is its asyncio twin.

Both validate and tokenize every prompt when called, queue them on the first iteration, and abort all
unfinished requests (their blocks go back to the pool) when the iterator is closed early, garbage-collected
or fails. Tokens are appended exactly once even when a request is preempted and recomputed, so a request's
events add up to its ``generate_many`` result.

With ``num_return_sequences=n`` (parallel sampling) every event says which of the prompt's sequences it
extends (``sequence_index``); each sequence's events add up to ``result.sequences[i]``, and the event that
finishes the prompt's last sequence carries the whole result. Beam search is not streamed (as in
``generate``): a beam's tokens are not final until the search ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from .core.request import Request, is_prompt_finished
from .detokenizer import IncrementalDetokenizer
from .engine import Client
from .generate import build_result, prepare, raise_if_failed
from .outputs import GenerationResult, RequestOutput


@dataclass
class StreamEvent:
    """New tokens of one request (one per step while decoding)."""

    index: int  # position of the prompt in the list given to stream_many
    request_id: str
    token_ids: list[int]  # the new ids
    text: str | None  # the new text (None without a tokenizer); "" while a character is incomplete
    finished: bool
    finish_reason: str | None  # "stop", "length", "time", "abort", "error" once finished
    logprobs: list[float] | None = None  # log-probs of token_ids when return_logprobs is on
    result: GenerationResult | None = None  # the whole result, on the prompt's last event
    sequence_index: int = 0  # which of the prompt's sequences these tokens extend (num_return_sequences > 1)


class _EventMaker:
    """Turns engine step outputs into StreamEvents (incremental text per request)."""

    def __init__(self, tokenizer: Any, requests: list[Request]):
        self.tokenizer = tokenizer
        self.by_index = {r.index: r for r in requests}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}  # by request id (one per sequence)
        self.reported: set[int] = set()  # prompts whose result went out

    def events(self, outputs: list[RequestOutput]) -> list[StreamEvent]:
        events = []
        for output in outputs:
            if output.finish_reason == "error":
                raise_if_failed(self.by_index[output.index])
            text = None
            if self.tokenizer is not None:
                detokenizer = self.detokenizers.get(output.request_id)
                if detokenizer is None:
                    detokenizer = IncrementalDetokenizer(self.tokenizer, start=output.num_prompt_tokens)
                    self.detokenizers[output.request_id] = detokenizer
                text = detokenizer.push(output.all_token_ids)
                if output.finished:
                    text += detokenizer.finish(output.all_token_ids)
            events.append(
                StreamEvent(
                    index=output.index,
                    request_id=output.request_id,
                    token_ids=list(output.new_token_ids),
                    text=text,
                    finished=output.finished,
                    finish_reason=output.finish_reason,
                    logprobs=output.new_logprobs,
                    sequence_index=output.sequence_index,
                )
            )
        for event in reversed(events):  # the whole result goes with the prompt's last event
            if event.finished and event.index not in self.reported:
                request = self.by_index[event.index]
                if is_prompt_finished(request):
                    event.result = build_result(request, self.tokenizer)
                    self.reported.add(event.index)
        return events


def _prepare(
    model: PreTrainedModel, prompts: Sequence[Any], generation_config: Any, tokenizer: Any, kwargs: dict[str, Any]
) -> tuple[Client, list[Request], _EventMaker]:
    if kwargs.get("streamer") is not None:
        raise ValueError("stream_many does not take streamer=: iterate over its events instead")
    kwargs = {k: v for k, v in kwargs.items() if k != "streamer"}
    client, requests, tokenizer = prepare(model, prompts, generation_config, tokenizer, kwargs)
    beams = next((r for r in requests if r.beam_search is not None), None)
    if beams is not None:
        raise ValueError(
            f"prompt {beams.index}: streaming does not support num_beams > 1 (a beam's tokens are final only when "
            "the search ends, and generate refuses a streamer with beam search too); use generate_many"
        )
    return client, requests, _EventMaker(tokenizer, requests)


def stream_many(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    generation_config: GenerationConfig | Sequence[GenerationConfig | None] | None = None,
    *,
    tokenizer: Any = None,
    **kwargs: Any,
) -> Iterator[StreamEvent]:
    """Like ``generate_many`` (same arguments), but yields a StreamEvent whenever a request gains tokens."""
    return _stream(*_prepare(model, prompts, generation_config, tokenizer, kwargs))


def _stream(client: Client, requests: list[Request], maker: _EventMaker) -> Iterator[StreamEvent]:
    try:
        client.submit(requests)
        while client.has_unfinished():
            yield from maker.events(client.step())
    finally:
        client.abort_all()
        client.core.sleep_if_asked()


def astream_many(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    generation_config: GenerationConfig | Sequence[GenerationConfig | None] | None = None,
    *,
    tokenizer: Any = None,
    **kwargs: Any,
) -> AsyncIterator[StreamEvent]:
    """``stream_many`` for asyncio: ``async for event in model.astream_many(...)``.

    Each engine step runs in a worker thread so the event loop stays responsive; streams of one model (from
    any tasks or threads) share its engine and its batches.
    """
    return _astream(*_prepare(model, prompts, generation_config, tokenizer, kwargs))


async def _astream(client: Client, requests: list[Request], maker: _EventMaker) -> AsyncIterator[StreamEvent]:
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfpaged-step")
    running: concurrent.futures.Future | None = None
    try:
        client.submit(requests)
        while client.has_unfinished():
            running = worker.submit(client.step)
            outputs = await asyncio.wrap_future(running)
            running = None
            for event in maker.events(outputs):
                yield event
    finally:
        if running is not None:  # cancelled mid-step: let the step finish before touching the engine
            concurrent.futures.wait([running])
        client.abort_all()
        client.core.sleep_if_asked()
        worker.shutdown(wait=False)
