"""The FastAPI application: routes, OpenAI-format errors, and the engine loop's start and stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..patch import stats as pool_stats
from .chat import create_chat_completion
from .completions import create_completion
from .context import ServingContext
from .engine_loop import EngineLoop
from .errors import APIError
from .logprobs import TokenStrings
from .request_params import ModelLimits

DEFAULT_MAX_WAITING = 1024


def model_limits(model: Any) -> ModelLimits:
    """Context length, KV pool capacity and vocabulary size of a patched model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_model_len = getattr(config, "max_position_embeddings", None)
    stats = pool_stats(model)
    return ModelLimits(
        max_model_len=int(max_model_len) if max_model_len else None,
        max_pool_tokens=stats["num_blocks"] * stats["block_size"],
        vocab_size=model.get_input_embeddings().weight.shape[0],
    )


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
    and frees the pool. While the app runs, submit work through it only: the engine is its alone.
    """
    if tokenizer is None:
        raise ValueError("hfpaged serve needs the model's tokenizer (pass tokenizer=)")
    if max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    engine_loop = EngineLoop(model, tokenizer, max_waiting=max_waiting)  # patches the model if it is not yet
    ctx = ServingContext(
        engine_loop=engine_loop,
        tokenizer=tokenizer,
        model_name=served_model_name or getattr(model, "name_or_path", None) or type(model).__name__,
        limits=model_limits(model),
        token_strings=TokenStrings(tokenizer),
        created=int(time.time()),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await engine_loop.stop()

    app = FastAPI(title="hfpaged", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = ctx

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        engine_loop.metrics.requests_rejected.labels(str(exc.status_code)).inc()
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(
            str(exc.detail), status_code=exc.status_code, code=None if exc.status_code != 404 else "not_found"
        )
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so the server log has the traceback
        error = APIError(f"Internal server error: {type(exc).__name__}: {exc}", status_code=500, type="server_error")
        return JSONResponse(error.body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        ctx.check_model(model_id)
        return _model_card(ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine_loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = engine_loop.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _model_card(ctx: ServingContext) -> dict:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "hfpaged",
        "max_model_len": ctx.limits.max_total_tokens,
    }
