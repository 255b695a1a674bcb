"""Run the app under uvicorn: in the foreground (``serve``) or in a background thread (``Server.start``)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any

DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds in-flight requests get to finish when the server stops
# While serving, the engine thread and the event loop share the GIL; a thread that wants it back waits up to
# the switch interval (Python's default: 5 ms, as long as a decode step) while the other one streams.
DEFAULT_SWITCH_INTERVAL = 0.001


class Server:
    """An hfpaged OpenAI-compatible server bound to ``host:port`` (port 0: any free port).

    ``run()`` serves in the foreground until Ctrl-C / SIGTERM; ``start()`` serves from a background thread
    and returns once it answers, ``stop()`` ends it. On stop, in-flight requests get ``shutdown_timeout``
    seconds to finish, the rest are aborted, and the KV pool is all free again. ``max_waiting``: requests
    accepted but not started (no token yet) at most, one more gets a 429. ``switch_interval``: the GIL
    switch interval while serving (see ``DEFAULT_SWITCH_INTERVAL``).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        served_model_name: str | None = None,
        max_waiting: int | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        log_level: str = "warning",
        switch_interval: float | None = DEFAULT_SWITCH_INTERVAL,
    ):
        import uvicorn

        from .app import DEFAULT_MAX_WAITING, create_app

        self.app = create_app(
            model,
            tokenizer,
            served_model_name=served_model_name,
            max_waiting=DEFAULT_MAX_WAITING if max_waiting is None else max_waiting,
        )
        self.host = host
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
            lifespan="on",
        )
        self.uvicorn = uvicorn.Server(config)
        self.switch_interval = switch_interval  # sys.setswitchinterval while serving (None: leave it)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port``; the OpenAI base URL is ``url + "/v1"``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def serving(self) -> Any:
        """The app's ``ServingContext`` (engine loop, tokenizer, limits)."""
        return self.app.state.serving

    def run(self) -> None:
        """Serve in this thread until interrupted (uvicorn handles SIGINT/SIGTERM in the main thread)."""
        previous = sys.getswitchinterval()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            sys.setswitchinterval(previous)

    def start(self, timeout: float = 60.0) -> Server:
        """Serve from a background thread; returns when the server accepts requests."""
        self.thread = threading.Thread(target=self.run, name=f"hfpaged-serve-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError("the hfpaged server failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hfpaged server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop a server started with ``start()``: finish or abort in-flight requests, free the pool."""
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError(f"the hfpaged server did not stop within {timeout} s")
        self.socket.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(
    model: Any,
    tokenizer: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    max_waiting: int | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    log_level: str = "info",
) -> None:
    """Serve ``model`` (already in memory; patched with defaults unless already patched) until interrupted."""
    server = Server(
        model,
        tokenizer,
        host=host,
        port=port,
        served_model_name=served_model_name,
        max_waiting=max_waiting,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
    )
    print(f"hfpaged: serving {server.serving.model_name} on {server.url}/v1 (Ctrl-C stops)", flush=True)
    server.run()
