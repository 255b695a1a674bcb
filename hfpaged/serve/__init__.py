"""``hfpaged serve``: an OpenAI-compatible HTTP server over one hfpaged engine (FastAPI + uvicorn).

    hfpaged serve MODEL_PATH --port 8000            # the console script (hfpaged.serve.cli)
    hfpaged.serve(model, tokenizer)                  # a model already in memory; blocks until Ctrl-C
                                                     # (the package is callable: hfpaged.serve.serve)
    with hfpaged.serve.Server(model, tokenizer, port=0) as server:   # in the background
        ...  # OpenAI(base_url=server.url + "/v1", api_key="unused")
    app = hfpaged.serve.create_app(model, tokenizer) # the single-process ASGI app, for any ASGI server

``Server`` keeps the engine in this process, beside the model, and runs HTTP in a child process (``server``
says why), or in ``api_server_count`` of them on the same port; ``create_app`` and
``Server(..., frontend_process=False)`` keep both in one process.

Needs the ``serve`` extra (``pip install hfpaged[serve]``: fastapi, uvicorn, prometheus_client); importing
this package does not, only building a server does.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .server import Server, serve

__all__ = ["Server", "create_app", "serve"]


class _CallablePackage(types.ModuleType):
    """``hfpaged.serve(model, tokenizer, ...)`` calls ``serve``; ``hfpaged.serve.Server`` etc. stay reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return serve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage


def __getattr__(name: str) -> Any:
    if name == "create_app":  # imported on use: it needs fastapi
        from .inprocess import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
