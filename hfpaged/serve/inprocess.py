"""The single-process server: the engine thread and the HTTP event loop in one process (``create_app``).

For embedding the app in an ASGI server of one's own, and ``Server(..., frontend_process=False)``. The two
share one GIL, so under many concurrent streams the per-token HTTP work slows the engine down; ``Server``
runs the front end in a process of its own by default (see ``frontend_process``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from .app import DEFAULT_MAX_WAITING, build_app
from .context import ServingContext
from .engine_client import EngineClient
from .engine_loop import EngineLoop, model_limits, served_model_name_of
from .logprobs import TokenStrings
from .messages import FrontendGone


def create_app(
    model: Any,
    tokenizer: Any,
    *,
    served_model_name: str | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
) -> FastAPI:
    """An OpenAI-compatible ASGI app over ``model`` (patched with defaults unless it is already patched).

    ``max_waiting`` bounds the requests accepted but not started (no token yet): one more gets a 429.
    The engine thread starts with the app's lifespan and, when the app stops, aborts what is still running
    and frees the pool. Other callers (``generate_many`` from another thread) may share the model meanwhile.
    """
    if tokenizer is None:
        raise ValueError("hfpaged serve needs the model's tokenizer (pass tokenizer=)")
    if max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    engine_loop = EngineLoop(model, tokenizer, max_waiting=max_waiting)
    return app_over(engine_loop, served_model_name_of(model, served_model_name), max_waiting)


def app_over(engine_loop: EngineLoop, model_name: str, max_waiting: int) -> FastAPI:
    """The app over an engine loop not started yet: its lifespan starts the engine thread and stops it."""
    tokenizer = engine_loop.engine.tokenizer
    client = EngineClient(max_waiting=max_waiting, stats=engine_loop.stats)
    ctx = ServingContext(
        engine=client,
        tokenizer=tokenizer,
        model_name=model_name,
        limits=model_limits(engine_loop.model),
        token_strings=TokenStrings(tokenizer),
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()

        def send(message: Any) -> None:  # engine thread -> event loop
            try:
                loop.call_soon_threadsafe(client.receive, message)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                raise FrontendGone("the event loop is closed") from None

        client.connect(engine_loop.put)  # front end 0, the only one
        engine_loop.start([send])
        try:
            yield
        finally:
            await client.stop()
            await loop.run_in_executor(None, engine_loop.thread.join, 60.0)

    app = build_app(ctx, lifespan)
    app.state.engine_loop = engine_loop
    return app
