"""``Server``: the engine beside the model in this process, the HTTP front end in processes of their own.

As vLLM splits its API server from its engine core: this process (which holds the model, so a model already
in memory can be served) runs only the engine thread (``EngineLoop``), and child processes (``frontend``)
run uvicorn and everything per token that is not engine work. They exchange small pickled messages, one per
engine step. ``api_server_count`` front ends (vLLM's ``--api-server-count``) accept on the same port, each
with its own channel to the engine thread, which sends every request's outputs to the front end that
submitted it (``frontend_process`` says how the port is shared). ``frontend_process=False`` keeps HTTP in
this process (``create_app``'s single-process app under uvicorn), sharing one GIL with the engine.
"""

from __future__ import annotations

import logging
import math
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("hfpaged.serve")

DEFAULT_SHUTDOWN_TIMEOUT = 10.0  # seconds in-flight requests get to finish when the server stops
DEFAULT_START_TIMEOUT = 120.0  # seconds the front-end process may take to start (its imports, mostly)
# Single-process mode: the engine thread and the event loop share the GIL; a thread that wants it back waits
# up to the switch interval (Python's default: 5 ms, as long as a decode step) while the other one streams.
DEFAULT_SWITCH_INTERVAL = 0.001


@dataclass
class ServedModel:
    """What this process knows of what it serves: the engine loop, the tokenizer, the name, the limits."""

    engine_loop: Any  # EngineLoop
    tokenizer: Any
    model_name: str
    limits: Any  # ModelLimits


class Server:
    """An hfpaged OpenAI-compatible server bound to ``host:port`` (port 0: any free port).

    ``run()`` serves in the foreground until Ctrl-C / SIGTERM; ``start()`` serves in the background and returns
    once it answers, ``stop()`` ends it. On stop, in-flight requests get ``shutdown_timeout`` seconds to finish,
    the rest are aborted, and the KV pool is all free again. ``max_waiting``: requests accepted but not started
    (no token yet) at most, over all front ends; one more gets a 429. ``frontend_process``: HTTP in child
    processes (default) or in a thread of this one; ``api_server_count``: how many child processes serve HTTP
    on the port (only with ``frontend_process``); ``switch_interval``: the GIL switch interval while serving
    single-process.
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
        frontend_process: bool = True,
        api_server_count: int = 1,
    ):
        from ..model.tensor_parallel import is_sharded
        from .engine_loop import EngineLoop, model_limits, served_model_name_of

        if tokenizer is None:
            raise ValueError("hfpaged serve needs the model's tokenizer (pass tokenizer=)")
        if is_sharded(model):
            raise ValueError(
                "hfpaged serve does not serve a tensor-parallel model (tp_plan): every rank would need the same "
                "request stream; use generate_many on every rank, or data-parallel replicas behind a load balancer"
            )
        self.max_waiting = 1024 if max_waiting is None else max_waiting
        _check_options(self.max_waiting, api_server_count, shutdown_timeout, switch_interval, log_level,
                       served_model_name)  # fmt: skip
        if api_server_count > 1 and not frontend_process:
            raise ValueError("api_server_count > 1 needs front-end processes: drop frontend_process=False")
        # patches the model with defaults if it is not yet; the engine bounds the waiting requests of all front ends
        engine_loop = EngineLoop(model, tokenizer, max_waiting=self.max_waiting)
        self.serving = ServedModel(
            engine_loop, tokenizer, served_model_name_of(model, served_model_name), model_limits(model)
        )
        self.host = host
        self.shutdown_timeout = shutdown_timeout
        self.log_level = log_level
        self.switch_interval = switch_interval  # sys.setswitchinterval while serving single-process (None: leave it)
        self.thread: threading.Thread | None = None  # the thread serving in this process (engine, or uvicorn)
        self.frontends: list = []  # FrontendProcess, one per api server
        self.frontend = None  # the first of them
        self.metrics_dir: str | None = None  # several front ends share their Prometheus files there
        self.uvicorn = None
        self.started = False  # a Server serves once (its socket and engine loop end with it)
        self.pickled_tokenizer = None
        if frontend_process:
            try:  # the front-end process gets the tokenizer pickled
                self.pickled_tokenizer = pickle.dumps(tokenizer)
                if b"__main__" in self.pickled_tokenizer:  # the child runs another __main__: it could not load it
                    raise pickle.PicklingError("it refers to classes or functions defined in the __main__ script")
            except Exception as error:  # e.g. a tokenizer holding a lambda or an open handle
                logger.warning(
                    "hfpaged serve: the tokenizer cannot be pickled for the front-end process (%s: %s); serving "
                    "HTTP from this process instead (as --single-process)%s",
                    type(error).__name__,
                    error,
                    f", one front end instead of api_server_count={api_server_count}" if api_server_count > 1 else "",
                )
                self.pickled_tokenizer = None
                frontend_process = False
                api_server_count = 1
        from .frontend_process import listening_sockets

        self.sockets = listening_sockets(host, port, api_server_count)  # one per front end, or one shared
        self.socket = self.sockets[0]
        self.port = self.socket.getsockname()[1]
        if frontend_process:
            from .frontend_process import FrontendProcess

            if api_server_count > 1:
                self.metrics_dir = tempfile.mkdtemp(prefix="hfpaged-metrics-")
            self.frontends = [
                FrontendProcess(
                    on_command=lambda command, index=index: engine_loop.put(command, index),
                    metrics_dir=self.metrics_dir,
                )
                for index in range(api_server_count)
            ]
            self.frontend = self.frontends[0]
        else:
            from .inprocess import app_over
            from .uvicorn_server import Server as UvicornServer

            self.app = app_over(engine_loop, self.serving.model_name, self.max_waiting)
            self.uvicorn = UvicornServer(self.app, log_level, shutdown_timeout)

    @property
    def url(self) -> str:
        """``http://host:port``; the OpenAI base URL is ``url + "/v1"``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in this thread until interrupted (SIGINT/SIGTERM) or until the front end ends."""
        if self.frontend is None:
            self._claim()
            self._run_uvicorn()
            return
        self.start(DEFAULT_START_TIMEOUT)
        stop = threading.Event()
        captured: list[int] = []
        handlers = {}
        if threading.current_thread() is threading.main_thread():

            def on_signal(signum: int, frame: Any) -> None:
                captured.append(signum)
                stop.set()

            handlers = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop.wait(0.2) and all(frontend.process.poll() is None for frontend in self.frontends):
                pass  # one front end that ends (a crash) stops the server
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            self.stop()
        for signum in reversed(captured):  # as uvicorn does: Ctrl-C ends in KeyboardInterrupt
            signal.raise_signal(signum)
        codes = [frontend.process.returncode for frontend in self.frontends]
        if not captured and any(code not in (0, -signal.SIGINT, -signal.SIGTERM) for code in codes):
            raise RuntimeError(f"the hfpaged front-end processes ended with codes {codes}")

    def start(self, timeout: float = 60.0) -> Server:
        """Serve in the background; returns when the server accepts requests."""
        self._claim()
        if self.frontend is None:
            self.thread = threading.Thread(target=self._run_uvicorn, name=f"hfpaged-serve-{self.port}", daemon=True)
            self.thread.start()
            self._wait(lambda: self.uvicorn.started, self.thread.is_alive, timeout)
            return self
        from .messages import FrontendConfig

        engine_loop = self.serving.engine_loop
        try:
            for index, (frontend, http_socket) in enumerate(zip(self.frontends, self.sockets)):
                config = FrontendConfig(
                    tokenizer=self.pickled_tokenizer,
                    sys_path=list(sys.path),
                    model_name=self.serving.model_name,
                    limits=self.serving.limits,
                    stats=engine_loop.stats,
                    max_waiting=self.max_waiting,
                    shutdown_timeout=self.shutdown_timeout,
                    log_level=self.log_level,
                    http_fd=-1,
                    api_server_index=index,
                )
                frontend.spawn(config, http_socket)
        except BaseException:
            for frontend in self.frontends:  # no engine thread yet to stop them gracefully: end those started
                frontend.wait_stopped(0)
            self.stop(0)  # sockets, metrics dir
            raise
        engine_loop.start([frontend.send for frontend in self.frontends])
        self.thread = engine_loop.thread
        try:
            deadline = time.monotonic() + timeout
            for frontend in self.frontends:
                frontend.wait_ready(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        for sock in self.sockets:  # the front ends have their own copies: once gone, connections are refused
            sock.close()
        return self

    def _claim(self) -> None:
        if self.started:  # a second start killed a running front end, or served nothing on a closed socket
            raise RuntimeError("this Server was started already; a Server serves once: make a new one to serve again")
        self.started = True

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the server: finish or abort in-flight requests, free the pool."""
        try:
            if self.frontend is None:
                self.uvicorn.should_exit = True
            else:
                self._stop_frontends(timeout)
            if self.thread is not None:
                self.thread.join(timeout)
                if self.thread.is_alive():
                    raise TimeoutError(f"the hfpaged server did not stop within {timeout} s")
        finally:
            for sock in self.sockets:
                sock.close()
            if self.metrics_dir is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _stop_frontends(self, timeout: float) -> None:
        from .messages import StopEngine

        try:
            for frontend in self.frontends:  # all at once: each gets shutdown_timeout for its requests
                frontend.ask_to_stop()
            for frontend in self.frontends:  # each tells the engine it is done as it ends
                frontend.wait_stopped(timeout)
        except BaseException:  # a second Ctrl-C: no front end (nor its channel) left behind
            for frontend in self.frontends:
                frontend.wait_stopped(0)
            raise
        finally:
            self.serving.engine_loop.put(StopEngine(), source=None)  # in case one could not

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run_uvicorn(self) -> None:
        previous = sys.getswitchinterval()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            sys.setswitchinterval(previous)

    @staticmethod
    def _wait(done: Any, alive: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if not alive():
                raise RuntimeError("the hfpaged server failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hfpaged server did not start within {timeout} s")
            time.sleep(0.01)


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
    frontend_process: bool = True,
    api_server_count: int = 1,
) -> None:
    """Serve ``model`` (already in memory; patched with defaults unless already patched) until interrupted;
    ``api_server_count`` front-end processes serve HTTP on the port (see ``Server``)."""
    server = Server(
        model,
        tokenizer,
        host=host,
        port=port,
        served_model_name=served_model_name,
        max_waiting=max_waiting,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        frontend_process=frontend_process,
        api_server_count=api_server_count,
    )
    print(f"hfpaged: serving {server.serving.model_name} on {server.url}/v1 (Ctrl-C stops)", flush=True)
    server.run()


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _check_options(max_waiting, api_server_count, shutdown_timeout, switch_interval, log_level, served_model_name):
    """``Server``'s options, checked before anything starts (a ValueError naming the option)."""
    for name, value in (("max_waiting", max_waiting), ("api_server_count", api_server_count)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value, low in (("shutdown_timeout", shutdown_timeout, 0), ("switch_interval", switch_interval, 1e-9)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if value is not None and not (ok and value >= low):
            more = ">= 0" if low == 0 else "> 0"
            raise ValueError(f"{name} must be None or a finite number of seconds {more}, got {value!r}")
    if not isinstance(log_level, str) or log_level.lower() not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {log_level!r}")
    if served_model_name is not None and not (isinstance(served_model_name, str) and served_model_name):
        raise ValueError(f"served_model_name must be a non-empty string or None, got {served_model_name!r}")
