"""The FastAPI application of the front end: routes, OpenAI-format errors, health and metrics.

It knows the engine only through the ``ServingContext``'s ``EngineClient``; who starts and stops the engine
side is the caller's ``lifespan`` (``create_app``: a thread in this process; ``Server``: the process that
holds the model, with this app in a front-end process of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .chat import create_chat_completion
from .completions import create_completion
from .context import ServingContext
from .errors import APIError

DEFAULT_MAX_WAITING = 1024


def build_app(ctx: ServingContext, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]]) -> FastAPI:
    """The OpenAI-compatible ASGI app over ``ctx``; ``lifespan`` connects (and at the end stops) the engine.

    The routes and handlers reach ``ctx`` through the request (``app.state.serving``), never a closure: FastAPI keeps
    endpoint functions in a module-level cache (``fastapi.dependencies.models``), and a closure over ``ctx`` kept its
    engine loop, the model and its KV pool alive after a stopped in-process server was dropped."""
    app = FastAPI(title="hfpaged", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = ctx

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        _ctx(request).engine.metrics.requests_rejected.labels(str(exc.status_code)).inc()
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client left while sending its body: nothing ran and nobody reads the answer (no traceback in the log)
        _ctx(request).engine.metrics.requests_rejected.labels("499").inc()
        return Response(status_code=499)

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
        return await create_completion(_ctx(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(_ctx(request), request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(_ctx(request))]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> dict:
        _ctx(request).check_model(model_id)
        return _model_card(_ctx(request))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        engine = _ctx(request).engine
        if engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable" if engine.send is not None else "not started"}, status_code=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = _ctx(request).engine.metrics.render()
        return Response(body, media_type=content_type)

    return app


def _ctx(request: Request) -> ServingContext:
    return request.app.state.serving


def _model_card(ctx: ServingContext) -> dict:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "hfpaged",
        "max_model_len": ctx.current_limits().max_total_tokens,
    }
