"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` as strict pydantic models.

Strict: no silent coercion ("5" is not an int), and a field this server does not know is refused by name,
as is a known OpenAI field it does not implement (``tools``, ``suffix``, ...) unless it is null or its
default. ``parse_request`` turns every failure into an OpenAI-format 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import invalid_request

# OpenAI fields this server accepts only when absent, null or set to the value named here.
UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "suffix": ("insertion (suffix)", ()),
    "best_of": ("best_of (server-side ranking of samples)", (1,)),
    "tools": ("tool calling", ()),
    "tool_choice": ("tool calling", ("none",)),
    "parallel_tool_calls": ("tool calling", (True, False)),  # meaningless without tools: any bool
    "functions": ("function calling", ()),
    "function_call": ("function calling", ("none",)),
    "response_format": ("structured output (response_format)", ({"type": "text"},)),
    "audio": ("audio output", ()),
    "modalities": ("output modalities other than text", (["text"],)),
    "prediction": ("predicted outputs", ()),
    "reasoning_effort": ("reasoning_effort", ()),
    "service_tier": ("service tiers", ("auto", "default")),
    "store": ("stored completions", (False,)),
    "metadata": ("stored completions (metadata)", ()),
    "web_search_options": ("web search", ()),
    "verbosity": ("verbosity", ()),
}

# What a union-typed field expects, for a readable message.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for an optional field means its default, as OpenAI reads it (some clients send them)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` (usage in a last chunk with no choices)."""

    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)  # OpenAI's limit; sampling also needs n <= max_num_seqs
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a JSON string key) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for OpenAI compatibility; not used


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One chat message; ``developer`` is passed to the chat template as ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None  # required but for the assistant (``parse_request``)
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


RequestT = TypeVar("RequestT", bound=SamplingRequest)


def parse_request(raw: bytes, request_type: type[RequestT]) -> RequestT:
    """Validate a raw JSON body; any problem is an OpenAI-format 400 naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, too deep, an int of > 4300 digits
        raise invalid_request(f"The request body is not valid JSON: {exc}"[:300]) from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {type(data).__name__}")
    try:  # json.loads takes nesting that the walks below (ours, pydantic's) may not
        request = _validate(data, request_type)
    except RecursionError:
        raise invalid_request("The request body is nested too deeply") from None
    if request.stream_options is not None and not request.stream:
        raise invalid_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    for index, message in enumerate(getattr(request, "messages", ())):
        if message.content is None and message.role != "assistant":
            param = f"messages[{index}].content"
            raise invalid_request(f"Missing required parameter: `{param}` (a {message.role} message)", param=param)
    return request


def _validate(data: dict, request_type: type[RequestT]) -> RequestT:
    """The parsed body as ``request_type``: lone surrogates, unsupported OpenAI fields, then the model's own rules."""
    for name, value in data.items():
        where = _invalid_text(value, name)
        if where is not None:
            raise invalid_request(f"`{where}` is not valid Unicode text (it holds a lone surrogate)", param=where)
    for name, (what, allowed) in UNSUPPORTED_FIELDS.items():
        if name in data:
            value = data.pop(name)
            # typed as the request's own fields are: true is not 1, nor 0 false
            if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
                raise invalid_request(f"`{name}` is not supported by hfpaged serve ({what})", param=name)
    try:
        return request_type.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _invalid_text(value: Any, where: str) -> str | None:
    """Where in a JSON value a string holds a lone surrogate (JSON allows ``\\ud800``; UTF-8 does not), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict) and any(_invalid_text(key, where) for key in value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _invalid_text(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if found is not None:
            return found
    return None


def _param(loc: tuple[Any, ...]) -> str:
    """``("messages", 0, "content", "str")`` -> ``"messages[0].content"`` (union tags dropped)."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif "[" in item or item in ("str", "int", "float", "bool") or item.startswith("function-"):
            continue
        else:
            out += f".{item}" if out else item
    return out


def _validation_error(exc: ValidationError):
    errors = exc.errors()
    first = errors[0]
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: `{param}`", param=param)
    leaf = param.rsplit(".", 1)[-1]
    if len(errors) > 1 and all(_param(e["loc"]).startswith(param) for e in errors) and leaf in _EXPECTED:
        return invalid_request(
            f"Invalid value for `{param}`: expected {_EXPECTED[leaf]}, got {first['input']!r:.80}", param=param
        )
    return invalid_request(f"Invalid value for `{param}`: {first['msg']} (got {first['input']!r:.80})", param=param)
