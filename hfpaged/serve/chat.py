"""``POST /v1/chat/completions``: messages through the tokenizer's chat template, ``chat.completion`` out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .context import ServingContext
from .errors import invalid_request
from .generation import Generation
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessage, parse_request
from .request_params import completion_budget, generate_kwargs
from .sse import ChunkWriter, event_stream, json_text, run_to_end, sse


def _content_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part_index, part in enumerate(message.content):
        where = f"messages[{index}].content[{part_index}]"
        if part.type != "text":
            raise invalid_request(
                f"content part type `{part.type}` is not supported: hfpaged serve takes text parts only", param=where
            )
        if part.text is None:
            raise invalid_request(f"`{where}` is a text part without `text`", param=f"{where}.text")
        texts.append(part.text)
    return "".join(texts)


def chat_prompt_token_ids(messages: list[ChatMessage], tokenizer: Any) -> list[int]:
    """The prompt the tokenizer's chat template makes of ``messages``, with the assistant turn opened."""
    if not messages:
        raise invalid_request("`messages` must contain at least one message", param="messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise invalid_request("The model's tokenizer has no chat template; use /v1/completions", param="messages")
    conversation = []
    for index, message in enumerate(messages):
        entry = {
            "role": "system" if message.role == "developer" else message.role,
            "content": _content_text(message, index),
        }
        if message.name is not None:
            entry["name"] = message.name
        conversation.append(entry)
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # the template's own checks (roles must alternate, ...) raise jinja errors
        raise invalid_request(f"The chat template rejected the messages: {exc}", param="messages") from None
    ids = list(ids)
    if not ids:
        raise invalid_request("The chat template made an empty prompt of the messages", param="messages")
    return ids


async def create_chat_completion(ctx: ServingContext, http_request: Request) -> Response:
    """Validate, apply the chat template, submit, and answer with JSON or an SSE stream of chunks."""
    arrival = time.perf_counter()
    request = parse_request(await http_request.body(), ChatCompletionRequest)
    ctx.check_model(request.model)
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid_request("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    prompt = await ctx.off_loop(chat_prompt_token_ids, request.messages, ctx.tokenizer)
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    kwargs = generate_kwargs(request, ctx.current_limits(), num_logprobs=num_logprobs)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    budget = completion_budget(max_tokens, len(prompt), ctx.current_limits(), default=None, prompt_param="messages")
    generation = Generation(ctx.engine, ctx.tokenizer, request, [prompt], [budget], kwargs, incremental=request.stream)
    await generation.start(arrival)
    header = {"id": f"chatcmpl-{generation.request_id}", "created": generation.created, "model": ctx.model_name}
    if request.stream:
        return event_stream(generation, http_request, _chunks(ctx, request, generation, header))
    if not await run_to_end(generation, http_request):
        return Response(status_code=499)  # the client is gone; nobody reads this
    choices = []
    for choice in generation.choices:
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(ctx.token_strings, choice.token_ids, choice.logprobs or [], choice.top_logprobs)
        choices.append(
            {
                "index": choice.index,
                "message": {"role": "assistant", "content": choice.text.text},
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        )
    return JSONResponse(
        {
            **header,
            "object": "chat.completion",
            "choices": choices,
            "usage": generation.usage(),
            "system_fingerprint": None,
        }
    )


async def _chunks(
    ctx: ServingContext, request: ChatCompletionRequest, generation: Generation, header: dict
) -> AsyncIterator[str]:
    header = {**header, "object": "chat.completion.chunk"}
    include_usage = request.stream_options is not None and request.stream_options.include_usage
    chunk = ChunkWriter(header, include_usage)
    for choice in generation.choices:
        yield chunk(
            f'{{"index":{choice.index},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
            '"finish_reason":null}'
        )
    async for delta in generation.deltas():
        index = delta.choice.index
        if delta.text or delta.token_ids:
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(ctx.token_strings, delta.token_ids, delta.logprobs or [], delta.top_logprobs)
            yield chunk(
                f'{{"index":{index},"delta":{{"content":{json_text(delta.text)}}},'
                f'"logprobs":{json_text(logprobs)},"finish_reason":null}}'
            )
        if delta.finish_reason is not None:
            yield chunk(
                f'{{"index":{index},"delta":{{}},"logprobs":null,"finish_reason":{json_text(delta.finish_reason)}}}'
            )
    if include_usage:
        yield sse({**header, "choices": [], "usage": generation.usage()})
