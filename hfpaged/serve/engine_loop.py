"""The one thread that owns the ``hfpaged.Engine`` of a server, and its bridge to asyncio.

The Engine is not thread-safe, so exactly one thread touches it. Request handlers (asyncio) put add and
abort commands on a thread-safe queue; the thread applies them between steps, steps while anything is
unfinished, and sleeps on the queue otherwise (no busy polling). Step outputs travel back with
``loop.call_soon_threadsafe`` and are routed, on the event loop, into one asyncio queue per API request.

Engine request ids are the submission ids; with ``num_return_sequences=n`` every output names its
submission as ``prompt_id`` (sequence i > 0 has request id ``"<id>.<i>"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine
from ..outputs import RequestOutput
from ..patch import stats as pool_stats
from .errors import APIError, invalid_request, queue_full, shutting_down
from .metrics import ServerMetrics

logger = logging.getLogger("hfpaged.serve")


class EngineFailure(Exception):
    """The engine failed while running a request (a bug, or the server stopped under it)."""


@dataclass
class Submission:
    """One engine request: a prompt and its generate settings (``num_sequences`` > 1 for parallel samples)."""

    request_id: str
    prompt_token_ids: list[int]
    generate_kwargs: dict[str, Any]
    num_sequences: int = 1


@dataclass
class _Route:
    """Where a submission's outputs go (event-loop side only), and its timing for the metrics."""

    sink: asyncio.Queue
    arrival_time: float
    num_unfinished: int
    first_token_time: float | None = None
    last_token_times: dict[int, float] = field(default_factory=dict)  # by sequence index


@dataclass
class _Add:
    submissions: list[Submission]
    accepted: asyncio.Future  # set from the engine thread: None, or the exception add_request raised


@dataclass
class _Abort:
    request_id: str


_STOP = object()


class EngineLoop:
    """Runs ``Engine.step`` in a background thread; handlers ``add`` and ``abort`` from the event loop."""

    def __init__(self, model: Any, tokenizer: Any, *, max_waiting: int):
        self.model = model
        self.engine = Engine(model, tokenizer=tokenizer)
        self.max_waiting = max_waiting
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stats: dict[str, Any] = pool_stats(model)  # the latest snapshot, written by the engine thread
        self.num_steps = 0
        # event-loop side
        self.loop: asyncio.AbstractEventLoop | None = None
        self.routes: dict[str, _Route] = {}
        self.waiting: set[str] = set()  # accepted (or being accepted), no token yet
        self.running: set[str] = set()  # producing tokens
        self.closing = False
        self.metrics = ServerMetrics(lambda: self.stats, lambda: len(self.running), lambda: len(self.waiting))
        # engine-thread side
        self.unfinished: dict[str, int] = {}  # submission id -> sequences not finished yet
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hfpaged-engine-loop", daemon=True)

    # --- event-loop side ----------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs are delivered on ``loop``."""
        self.loop = loop
        self.thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and can take requests."""
        return self.thread.is_alive() and self.failed is None and not self.closing

    async def add(self, submissions: list[Submission], arrival_time: float) -> asyncio.Queue:
        """Queue ``submissions`` (all or none); returns the asyncio queue their ``RequestOutput``s arrive on.

        Raises a 429 when the waiting queue is full, a 400 when the engine refuses a setting, a 503 while
        stopping.
        """
        if self.closing or not self.alive:
            raise shutting_down()
        if len(self.waiting) + len(submissions) > self.max_waiting:
            raise queue_full(self.max_waiting)
        sink: asyncio.Queue = asyncio.Queue()
        for submission in submissions:
            self.routes[submission.request_id] = _Route(sink, arrival_time, submission.num_sequences)
            self.waiting.add(submission.request_id)
        accepted = self.loop.create_future()
        self.commands.put(_Add(submissions, accepted))
        ids = [s.request_id for s in submissions]
        try:
            error = await accepted
        except BaseException:  # cancelled while the engine thread adds them: take them back
            self.abort(ids)
            raise
        if error is not None:
            self._forget(ids)
            if isinstance(error, (ValueError, TypeError)):
                raise invalid_request(str(error)) from None
            raise APIError(f"The engine failed to add the request: {error}", status_code=500, type="server_error")
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_token_ids) for s in submissions))
        return sink

    def abort(self, request_ids: list[str]) -> None:
        """Stop these submissions (if still running) and free their blocks; their outputs stop coming."""
        for request_id in request_ids:
            if self._forget([request_id]):
                self.metrics.requests_finished.labels("abort").inc()
                self.commands.put(_Abort(request_id))

    def is_active(self, request_id: str) -> bool:
        """Whether a submission is still routed (not finished, not aborted)."""
        return request_id in self.routes

    async def stop(self, timeout: float = 60.0) -> None:
        """Abort what is left, let the engine drain its in-flight step, and end the thread (pool all free)."""
        self.closing = True
        if self.thread.is_alive():
            self.commands.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join, timeout)
        self._fail(list(self.routes), EngineFailure("the server stopped before this request finished"))

    def _forget(self, request_ids: list[str]) -> bool:
        """Drop the routes of ``request_ids``; whether any was still routed."""
        found = False
        for request_id in request_ids:
            found |= self.routes.pop(request_id, None) is not None
            self.waiting.discard(request_id)
            self.running.discard(request_id)
        return found

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        metrics.generation_tokens.inc(sum(len(output.new_token_ids) for output in outputs))
        for output in outputs:
            request_id = output.prompt_id
            route = self.routes.get(request_id)
            if route is None:  # aborted meanwhile
                continue
            if route.first_token_time is None:
                route.first_token_time = now
                self.waiting.discard(request_id)
                self.running.add(request_id)
                metrics.time_to_first_token.observe(now - route.arrival_time)
            last = route.last_token_times.get(output.sequence_index)
            if last is not None:
                metrics.inter_token_latency.observe(now - last)
            route.last_token_times[output.sequence_index] = now
            if output.finished:
                metrics.requests_finished.labels(output.finish_reason or "stop").inc()
                route.num_unfinished -= 1
                if route.num_unfinished == 0:
                    metrics.e2e_latency.observe(now - route.arrival_time)
                    self._forget([request_id])
            route.sink.put_nowait(output)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        sinks = {id(route.sink): route.sink for rid in request_ids if (route := self.routes.get(rid)) is not None}
        self._forget(request_ids)
        for sink in sinks.values():
            sink.put_nowait(error)

    # --- engine thread ------------------------------------------------------------------------------

    def _call(self, callback: Callable, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = []
                if not engine.has_unfinished():
                    self.stats = pool_stats(self.model)
                    commands.append(self.commands.get())  # sleep until there is work
                while True:
                    try:
                        commands.append(self.commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        self._drain()
                        return
                    self._apply(command)
                if engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # pragma: no cover - a bug: report it to every waiting request
            logger.exception("hfpaged engine loop died")
            self.failed = exc
            self._call(self._fail, list(self.unfinished), EngineFailure(f"the engine loop died: {exc!r}"))

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            self.unfinished.pop(command.request_id, None)
            return
        added = []
        error = None
        try:
            for submission in command.submissions:
                self.engine.add_request(
                    submission.prompt_token_ids, request_id=submission.request_id, **submission.generate_kwargs
                )
                added.append(submission.request_id)
                self.unfinished[submission.request_id] = submission.num_sequences
        except Exception as exc:  # ValueError/TypeError: a bad setting; the handler answers 400
            error = exc
            for request_id in added:
                self.engine.abort(request_id)
                self.unfinished.pop(request_id, None)
        self._call(_resolve, command.accepted, error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("hfpaged engine step failed; aborting the requests in it")
            failed = list(self.unfinished)
            for request_id in failed:
                self.engine.abort(request_id)
            self.unfinished.clear()
            self._call(self._fail, failed, EngineFailure(f"the engine step failed: {exc!r}"))
            return
        self.num_steps += 1
        for output in outputs:
            if output.finished:
                request_id = output.prompt_id
                left = self.unfinished.get(request_id)
                if left is not None:
                    if left <= 1:
                        del self.unfinished[request_id]
                    else:
                        self.unfinished[request_id] = left - 1
        self.stats = pool_stats(self.model)
        if outputs:
            self._call(self._deliver, outputs)

    def _drain(self) -> None:
        """Stop: abort every unfinished request, then step until the engine holds nothing in flight."""
        for request_id in list(self.unfinished):
            self.engine.abort(request_id)
        self.unfinished.clear()
        for _ in range(1000):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        self.stats = pool_stats(self.model)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
