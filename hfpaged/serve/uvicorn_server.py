"""uvicorn's server, with the end of a graceful shutdown in hfpaged's hands.

On stop, uvicorn gives in-flight requests ``timeout_graceful_shutdown`` seconds and then cancels their tasks itself:
each such request logged an "Exception in ASGI application" traceback (``CancelledError``), and a client waiting for a
whole answer got uvicorn's plain-text 500. Here, at ``shutdown_timeout``, the requests still in flight are aborted in the
engine and failed in the client (``EngineClient.fail_in_flight``): their handlers answer with an OpenAI error (an SSE
error event for a stream) within the ``GRACE`` seconds before uvicorn's own deadline.
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI

GRACE = 2.0  # seconds between the requests' failure and uvicorn's own deadline: their handlers answer in between


class Server(uvicorn.Server):
    """``uvicorn.Server`` over an hfpaged app (its ``state.serving.engine`` is the ``EngineClient``)."""

    def __init__(self, app: FastAPI, log_level: str, shutdown_timeout: float | None):
        timeout = None if shutdown_timeout is None else shutdown_timeout + GRACE
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=timeout, lifespan="on"))
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        timer = None
        if self.shutdown_timeout is not None:
            timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._fail_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _fail_in_flight(self) -> None:
        self.config.app.state.serving.engine.fail_in_flight(
            f"the server stopped: its shutdown timeout ({self.shutdown_timeout} s) ran out before this request finished"
        )
