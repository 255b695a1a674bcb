"""The front end's view of the engine: submissions out, token deltas routed to each API request's queue.

Runs on the HTTP event loop only. ``add`` registers a route per submission and sends ``AddRequests``; the
engine side answers ``Added`` and then one ``StepOutputs`` per step, which ``receive`` routes by submission
id into per-request asyncio queues, counting waiting/running requests and the latency metrics as it goes.
Whether the engine thread is in this process or in the one that holds the model, only ``send`` differs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, invalid_request, model_unpatched, not_started, queue_full, shutting_down
from .messages import (
    AbortRequests,
    Added,
    AddRequests,
    EngineDied,
    EngineFailure,
    EngineStats,
    EngineStopped,
    RequestsFailed,
    StepOutputs,
    StopEngine,
    Submission,
    TokenDelta,
)
from .metrics import ServerMetrics


@dataclass
class _Route:
    """Where a submission's outputs go, and its timing for the metrics."""

    sink: asyncio.Queue
    arrival_time: float
    num_unfinished: int
    first_token_time: float | None = None
    last_token_times: dict[int, float] = field(default_factory=dict)  # by sequence index


class EngineClient:
    """Submits to the engine side and routes what comes back; ``connect`` it to a ``send`` first."""

    def __init__(
        self,
        *,
        max_waiting: int,
        stats: dict[str, Any] | None = None,
        api_server_index: int = 0,
        metrics_dir: str | None = None,
    ):
        self.max_waiting = max_waiting
        self.stats: dict[str, Any] = dict(stats or {})  # the engine's latest pool figures
        self.send: Callable[[Any], None] | None = None
        self.routes: dict[str, _Route] = {}
        self.waiting: set[str] = set()  # accepted (or being accepted), no token yet
        self.running: set[str] = set()  # producing tokens
        self.pending: dict[int, asyncio.Future] = {}  # AddRequests tag -> its answer
        self.tags = itertools.count()
        self.closing = False
        self.failure: str | None = None  # why the engine is unreachable, once it is
        self.stopped: asyncio.Event | None = None
        self.metrics = ServerMetrics(
            lambda: self.stats,
            lambda: len(self.running),
            lambda: len(self.waiting),
            api_server_index=api_server_index,
            multiprocess_dir=metrics_dir,
        )

    def connect(self, send: Callable[[Any], None]) -> None:
        """Commands go to ``send`` from now on (call on the event loop)."""
        self.send = send
        self.stopped = asyncio.Event()
        self.closing, self.failure = False, None  # (an app's lifespan may run again after one ended)

    @property
    def alive(self) -> bool:
        """Whether the engine can take requests."""
        return self.send is not None and self.failure is None and not self.closing

    async def add(self, submissions: list[Submission], arrival_time: float) -> asyncio.Queue:
        """Queue ``submissions`` (all or none); returns the asyncio queue their ``TokenDelta``s arrive on.

        Raises a 429 when the waiting queue is full, a 400 when the engine refuses a setting, a 503 while
        stopping.
        """
        if self.send is None:
            raise not_started()
        if not self.alive:
            raise shutting_down()
        if len(submissions) > self.max_waiting:  # could never be admitted: not a 429 that a retry would fix
            raise invalid_request(
                f"this request starts {len(submissions)} generations (one per prompt, times `n` when "
                f"greedy) but at most {self.max_waiting} may wait at once (the server's --max-waiting); send fewer"
            )
        if len(self.waiting) + len(submissions) > self.max_waiting:
            raise queue_full(self.max_waiting)
        sink: asyncio.Queue = asyncio.Queue()
        for submission in submissions:
            self.routes[submission.request_id] = _Route(sink, arrival_time, submission.num_sequences)
            self.waiting.add(submission.request_id)
        self.metrics.update_counts()
        tag = next(self.tags)
        accepted = self.pending[tag] = asyncio.get_running_loop().create_future()
        self.send(AddRequests(tag, submissions))
        ids = [s.request_id for s in submissions]
        try:
            error = await accepted
        except BaseException:  # cancelled while the engine adds them: take them back
            self.pending.pop(tag, None)
            self.abort(ids)
            raise
        if error is not None:
            self._forget(ids)
            if isinstance(error, EngineFailure):
                raise APIError(str(error), status_code=503, type="server_error")
            kind, message = error
            if kind == "invalid":
                raise invalid_request(message) from None
            if kind == "queue_full":  # the engine's bound, over every front end's requests
                raise queue_full(self.max_waiting)
            if kind == "unavailable":
                raise model_unpatched()
            raise APIError(f"The engine failed to add the request: {message}", status_code=500, type="server_error")
        self.metrics.prompt_tokens.inc(sum(len(s.prompt_token_ids) for s in submissions))
        self.metrics.api_server_requests.inc()
        return sink

    def abort(self, request_ids: list[str]) -> None:
        """Stop these submissions (if still running) and free their blocks; their outputs stop coming."""
        aborted = [request_id for request_id in request_ids if self._forget([request_id])]
        if aborted:
            self.metrics.requests_finished.labels("abort").inc(len(aborted))
            if self.failure is None:
                self.send(AbortRequests(aborted))

    def is_active(self, request_id: str) -> bool:
        """Whether a submission is still routed (not finished, not aborted)."""
        return request_id in self.routes

    async def stop(self, timeout: float = 60.0) -> None:
        """Let the engine abort what is left and drain; then fail whatever still waits here."""
        self.closing = True
        if self.send is not None and self.failure is None:
            self.send(StopEngine())
            try:
                await asyncio.wait_for(self.stopped.wait(), timeout)
            except asyncio.TimeoutError:
                self.lost(f"the engine did not stop within {timeout} s")
        self._fail(list(self.routes), EngineFailure("the server stopped before this request finished"))

    def fail_in_flight(self, reason: str) -> None:
        """Abort every request still in flight in the engine and answer it with an error (the server's shutdown
        timeout ran out); a request that reaches ``add`` from now on gets a 503, as after ``stop``."""
        self.closing = True
        request_ids = list(self.routes)
        if request_ids and self.send is not None and self.failure is None:
            self.send(AbortRequests(request_ids))
            self.metrics.requests_finished.labels("abort").inc(len(request_ids))
        self._fail(request_ids, EngineFailure(reason))

    def lost(self, reason: str) -> None:
        """The engine is unreachable (its process or thread ended): fail everything in flight."""
        if self.failure is None:
            self.failure = reason
        for future in self.pending.values():
            if not future.done():
                future.set_result(EngineFailure(f"The engine is unavailable: {reason}"))
        self.pending.clear()
        self._fail(list(self.routes), EngineFailure(reason))
        if self.stopped is not None:
            self.stopped.set()

    # --- what the engine side sends -----------------------------------------------------------------

    def receive(self, message: Any) -> None:
        """Take one message from the engine side (on the event loop)."""
        if isinstance(message, StepOutputs):
            if message.stats is not None:
                self.stats = message.stats
            self._deliver(message.deltas())
        elif isinstance(message, Added):
            future = self.pending.pop(message.tag, None)
            if future is not None and not future.done():
                future.set_result(message.error)
        elif isinstance(message, EngineStats):
            self.stats = message.stats
        elif isinstance(message, RequestsFailed):
            self._fail(message.request_ids, EngineFailure(message.message))
        elif isinstance(message, EngineStopped):
            self.stats = message.stats
            self.stopped.set()
        elif isinstance(message, EngineDied):
            self.lost(message.message)
        else:
            raise TypeError(f"unexpected message from the engine: {message!r}")

    def _forget(self, request_ids: list[str]) -> bool:
        """Drop the routes of ``request_ids``; whether any was still routed."""
        found = False
        for request_id in request_ids:
            found |= self.routes.pop(request_id, None) is not None
            self.waiting.discard(request_id)
            self.running.discard(request_id)
        self.metrics.update_counts()
        return found

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        metrics.generation_tokens.inc(sum(len(delta.new_token_ids) for delta in deltas))
        routes = self.routes
        for delta in deltas:
            request_id = delta.prompt_id
            route = routes.get(request_id)
            if route is None:  # aborted meanwhile
                continue
            if route.first_token_time is None:
                route.first_token_time = now
                self.waiting.discard(request_id)
                self.running.add(request_id)
                metrics.time_to_first_token.observe(now - route.arrival_time)
            last = route.last_token_times.get(delta.sequence_index)
            if last is not None:
                metrics.inter_token_latency.observe(now - last)
            route.last_token_times[delta.sequence_index] = now
            if delta.finish_reason is not None:
                metrics.requests_finished.labels(delta.finish_reason).inc()
                route.num_unfinished -= 1
                if route.num_unfinished == 0:
                    metrics.e2e_latency.observe(now - route.arrival_time)
                    self._forget([request_id])
            route.sink.put_nowait(delta)
        metrics.update_counts()  # first tokens moved requests from waiting to running

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        sinks = {id(route.sink): route.sink for rid in request_ids if (route := self.routes.get(rid)) is not None}
        self._forget(request_ids)
        for sink in sinks.values():
            sink.put_nowait(error)
