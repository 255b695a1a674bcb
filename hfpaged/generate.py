"""``generate_many``: every prompt through the model's engine, results in input order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .core.request import Request
from .engine import UNPATCHED, Client, ModelUnpatched, engine_of
from .model.tensor_parallel import making_requests
from .outputs import GenerationResult, SequenceOutput
from .prompt_forms import prompt_list
from .prompts import check_tokenizer


def _sequences(request: Request, tokenizer: Any) -> list[SequenceOutput]:
    """Every sequence returned for the prompt of ``request`` (its first request)."""

    def decode(token_ids: list[int]) -> str | None:
        return tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None

    search = request.beam_search
    if search is not None:
        return [
            SequenceOutput(s.token_ids, decode(s.token_ids), s.finish_reason, score=s.score)
            for s in search.returned_sequences()
        ]
    return [
        SequenceOutput(
            token_ids=m.output_token_ids,
            text=decode(m.output_token_ids),
            finish_reason=m.finish_reason or "length",
            logprobs=None if m.logprobs is None else list(m.logprobs),
            top_logprobs=None if m.top_logprobs is None else list(m.top_logprobs),
        )
        for m in request.members
    ]


def build_result(request: Request, tokenizer: Any) -> GenerationResult:
    """The GenerationResult of a finished (or aborted) prompt, with every sequence of it."""
    sequences = _sequences(request, tokenizer)
    first = sequences[0]
    metrics = {}
    finish_times = [m.finish_time for m in request.members]
    if request.first_token_time is not None and None not in finish_times:
        latency = max(finish_times) - request.arrival_time
        num_tokens = sum(len(s.token_ids) for s in sequences)
        metrics = {
            "time_to_first_token": request.first_token_time - request.arrival_time,
            "latency": latency,
            "tokens_per_second": num_tokens / latency if latency > 0 else 0.0,
        }
    return GenerationResult(
        prompt_token_ids=request.prompt_token_ids,
        token_ids=first.token_ids,
        text=first.text,
        finish_reason=first.finish_reason,
        metrics=metrics,
        logprobs=first.logprobs,
        top_logprobs=first.top_logprobs,
        sequences=sequences,
    )


def prepare(
    model: PreTrainedModel, prompts: Any, generation_config: Any, tokenizer: Any, kwargs: dict[str, Any]
) -> tuple[Client, list[Request], Any]:
    """A client on the model's engine and the validated requests of a call (not queued yet); the tokenizer."""
    core = engine_of(model)
    try:
        with making_requests(core.state):  # tensor parallel: a rank's refusal is every rank's
            kwargs = dict(kwargs)
            prompts = prompt_list(prompts, kwargs)
            core.check_weights(model)
            check_tokenizer(tokenizer)
            tokenizer = tokenizer if tokenizer is not None else core.state.tokenizer
            requests = core.prompts.make_many(prompts, generation_config, kwargs, tokenizer)
    except ReferenceError:  # unpatched by another thread meanwhile
        raise ModelUnpatched(UNPATCHED) from None
    return Client(core), requests, tokenizer


def raise_if_failed(request: Request) -> None:
    """A prompt that finished with an error ends the call with it: what a callback of its own (logits processor,
    stopping criterion, ``prefix_allowed_tokens_fn``) raised, as it raised it, or a RuntimeError naming the prompt
    (its sampling hit NaN/inf scores)."""
    failed = next((m for m in request.members if m.finish_reason == "error"), None)
    if failed is not None:
        if failed.exception is not None:
            raise failed.exception
        raise RuntimeError(f"prompt {request.index}: {failed.error}")


def generate_many(
    model: PreTrainedModel,
    prompts: Sequence[Any],
    generation_config: GenerationConfig | Sequence[GenerationConfig | None] | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = False,
    streamer: Any = None,
    **kwargs: Any,
) -> list[GenerationResult]:
    """Generate for every prompt with continuous batching over the paged KV pool; results in input order.

    ``generation_config``/``kwargs`` mean what they mean for ``model.generate`` (every GenerationConfig
    field, ``logits_processor=``, ``stopping_criteria=``, ``prefix_allowed_tokens_fn=``; ``stop_strings``
    need a tokenizer). Extras: ``seed`` (prompt i gets seed + i), ``presence_penalty``,
    ``frequency_penalty``, ``logit_bias`` ({token id: value}, vLLM semantics, applied after the
    logits processors and before the sampling warpers), ``return_logprobs`` and ``top_logprobs``.

    Several sequences per prompt: ``num_return_sequences=n`` with ``do_sample=True`` draws n samples that share
    the prompt's KV blocks; ``num_beams=k`` runs transformers' beam search (``length_penalty``,
    ``early_stopping``, ``num_return_sequences <= k``). Each result's ``sequences`` holds them all.

    Per prompt: ``generation_config`` may be a list (one config or None per prompt), and a prompt may be a
    dict ``{"prompt": ..., "generation_config": ..., **settings}`` whose config replaces the call's and
    whose settings (any of the above, ``seed`` included) override the call's keyword arguments.
    ``streamer=`` (a transformers ``TextStreamer``/``TextIteratorStreamer``) needs exactly one prompt.
    Safe to call from several threads at once: the calls share the model's engine and its batches.
    """
    client, requests, tokenizer = prepare(model, prompts, generation_config, tokenizer, kwargs)
    if streamer is not None and len(requests) != 1:
        raise ValueError(
            f"streamer= works with exactly one prompt, got {len(requests)}; use model.stream_many() to stream many"
        )
    if not requests:
        if client.core.state.tp is not None:
            client.submit(requests)  # tensor parallel: an empty call is compared with the other ranks' calls too
        return []
    if streamer is None and not progress:  # nothing reads the steps' outputs: the finished requests' only
        for request in requests:
            request.stream_outputs = False
    if streamer is not None and requests[0].group is not None:
        raise ValueError(
            "streamer= streams one sequence: not with num_beams > 1 or num_return_sequences > 1 "
            "(model.stream_many() streams parallel samples)"
        )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="generate_many", unit="req")
    start = time.perf_counter()
    num_generated = 0
    try:
        client.submit(requests)
        if streamer is not None:
            streamer.put(torch.tensor([requests[0].prompt_token_ids]))
        while client.has_unfinished():
            outputs = client.step()
            num_generated += len(outputs)
            for output in outputs:
                if output.finish_reason == "error":
                    raise_if_failed(requests[output.index])
                elif output.finish_reason == "abort":  # only unpatch (or a re-patch) aborts this call's prompts
                    raise RuntimeError(
                        "the model was unpatched (or patched again with other settings) while generate_many ran: "
                        "its prompts were aborted"
                    )
            if streamer is not None:
                for output in outputs:
                    streamer.put(torch.tensor(output.new_token_ids))
            if bar is not None:
                done = sum(1 for o in outputs if o.finished and o.sequence_index == 0)
                if done:
                    bar.update(done)
                elapsed = time.perf_counter() - start
                bar.set_postfix(tok_s=f"{num_generated / max(elapsed, 1e-9):.1f}", refresh=False)
    except BaseException as error:
        client.abort_all()
        if streamer is not None:
            _end_streamer_after(streamer, error)
        raise
    finally:
        if bar is not None:
            bar.close()
        client.core.sleep_if_asked()
    if streamer is not None:
        streamer.end()
    return [build_result(request, tokenizer) for request in requests]


def _end_streamer_after(streamer: Any, error: BaseException) -> None:
    """Close the streamer after a failure without hiding the failure if ``end()`` raises too."""
    try:
        streamer.end()
    except Exception as end_error:
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"(the streamer's end() also failed: {type(end_error).__name__}: {end_error})")
