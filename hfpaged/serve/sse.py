"""How a generation reaches the client: server-sent events in OpenAI's framing, and noticing a client that left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .errors import APIError
from .generation import Generation, RequestClosed
from .messages import EngineFailure

SSE_DONE = "data: [DONE]\n\n"
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder: the hot path


def sse(data: dict[str, Any]) -> str:
    """One ``data: {json}`` event."""
    return f"data: {_encode(data)}\n\n"


class ChunkWriter:
    """Stream chunks with the header (id, object, created, model) serialized once: only the choice is new."""

    def __init__(self, header: dict[str, Any], include_usage: bool):
        self.prefix = "data: " + _encode(header)[:-1] + ',"choices":['
        self.suffix = "]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def __call__(self, choice_json: str) -> str:
        """The ``data:`` event of a chunk with one choice, given that choice as JSON text."""
        return self.prefix + choice_json + self.suffix


def json_text(value: Any) -> str:
    """``value`` as compact JSON (``null`` for None)."""
    return _encode(value)


def watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """A task that calls ``on_disconnect`` when the client closes the connection (cancel it when done).

    Call it once the body has been read: the next ASGI message of the request is then the disconnect.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.ensure_future(watch())


async def run_to_end(generation: Generation, request: Request) -> bool:
    """Run a non-streaming generation to its end; False if the client left first (then it is aborted)."""
    watcher = watch_disconnect(request, generation.close)
    try:
        await generation.wait()
        return True
    except RequestClosed:
        return False
    except EngineFailure as exc:
        raise APIError(str(exc), status_code=500, type="server_error") from None
    finally:
        watcher.cancel()
        generation.close()


def event_stream(generation: Generation, request: Request, chunks: AsyncIterator[str]) -> StreamingResponse:
    """An SSE response of ``chunks`` then ``[DONE]``; a client that leaves aborts the generation at once."""

    async def body() -> AsyncIterator[str]:
        watcher = watch_disconnect(request, generation.close)
        try:
            async for chunk in chunks:
                yield chunk
            yield SSE_DONE
        except RequestClosed:
            return
        except EngineFailure as exc:
            yield sse(APIError(str(exc), status_code=500, type="server_error").body())
        finally:
            watcher.cancel()
            generation.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
