"""``POST /v1/completions``: text (or token-id) prompts in, OpenAI ``text_completion`` objects out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .context import ServingContext
from .errors import invalid_request
from .generation import Generation
from .logprobs import TextOffsets, completion_logprobs
from .protocol import CompletionRequest, parse_request
from .request_params import completion_budget, generate_kwargs
from .sse import ChunkWriter, event_stream, json_text, run_to_end, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def prompt_token_ids(prompt: str | list, tokenizer: Any) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt: ``prompt`` is a string, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise invalid_request("`prompt` must not be empty", param="prompt")
    all_ids, texts = [], []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            ids, text = list(tokenizer(item)["input_ids"]), item
        else:
            ids, text = list(item), None
        if not ids:
            where = "`prompt`" if len(prompt) == 1 else f"`prompt[{index}]`"
            raise invalid_request(f"{where} is empty: it has no tokens", param="prompt")
        all_ids.append(ids)
        texts.append(text)
    return all_ids, texts


async def create_completion(ctx: ServingContext, http_request: Request) -> Response:
    """Validate, submit, and answer with one JSON object or an SSE stream of chunks."""
    arrival = time.perf_counter()
    request = parse_request(await http_request.body(), CompletionRequest)
    ctx.check_model(request.model)
    if request.echo and request.logprobs is not None:
        raise invalid_request(
            "`echo` with `logprobs` needs prompt log-probs, which hfpaged does not compute", param="echo"
        )
    prompts, texts = await ctx.off_loop(prompt_token_ids, request.prompt, ctx.tokenizer)
    kwargs = generate_kwargs(request, ctx.current_limits(), num_logprobs=request.logprobs)
    budgets = [
        completion_budget(
            request.max_tokens, len(p), ctx.current_limits(), default=DEFAULT_MAX_TOKENS, prompt_param="prompt"
        )
        for p in prompts
    ]
    generation = Generation(ctx.engine, ctx.tokenizer, request, prompts, budgets, kwargs, incremental=request.stream)
    await generation.start(arrival)
    echoes = [""] * len(prompts)
    if request.echo:
        echoes = [text if text is not None else ctx.tokenizer.decode(ids) for ids, text in zip(prompts, texts)]
    header = {
        "id": f"cmpl-{generation.request_id}",
        "object": "text_completion",
        "created": generation.created,
        "model": ctx.model_name,
    }
    if request.stream:
        return event_stream(generation, http_request, _chunks(ctx, request, generation, header, echoes))
    if not await run_to_end(generation, http_request):
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for choice in generation.choices:
        echo = echoes[choice.prompt_index]
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(
                ctx.token_strings,
                choice.token_ids,
                choice.logprobs or [],
                choice.top_logprobs,
                TextOffsets(ctx.tokenizer, len(echo)),
                text_end=len(echo) + len(choice.text.text),
            )
        choices.append(
            {
                "index": choice.index,
                "text": echo + choice.text.text,
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        )
    return JSONResponse({**header, "choices": choices, "usage": generation.usage(), "system_fingerprint": None})


async def _chunks(
    ctx: ServingContext, request: CompletionRequest, generation: Generation, header: dict, echoes: list[str]
) -> AsyncIterator[str]:
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    chunk = ChunkWriter(header, include_usage)
    text_offsets = [TextOffsets(ctx.tokenizer, len(echoes[c.prompt_index])) for c in generation.choices]
    if request.echo:
        for choice in generation.choices:
            yield chunk(
                f'{{"index":{choice.index},"text":{json_text(echoes[choice.prompt_index])},'
                '"logprobs":null,"finish_reason":null}'
            )
    async for delta in generation.deltas():
        index = delta.choice.index
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(
                ctx.token_strings,
                delta.token_ids,
                delta.logprobs or [],
                delta.top_logprobs,
                text_offsets[index],
                text_end=len(echoes[delta.choice.prompt_index]) + len(delta.choice.text.text),  # handed out so far
            )
        yield chunk(
            f'{{"index":{index},"text":{json_text(delta.text)},"logprobs":{json_text(logprobs)},'
            f'"finish_reason":{json_text(delta.finish_reason)}}}'
        )
    if include_usage:
        yield sse({**header, "choices": [], "usage": generation.usage()})
