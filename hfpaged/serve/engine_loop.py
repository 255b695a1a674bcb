"""The engine side of a server: one thread, beside the model, that runs ``Engine.step`` and ships token ids.

It lives in the process that holds the model and does nothing but engine work: commands (``messages``)
come in on a thread-safe queue, are applied between steps (adds, aborts), the thread steps while anything
is unfinished and sleeps on the queue otherwise (no busy polling). Each step's outputs leave as one
``StepOutputs`` message of ``TokenDelta``s per front end, through that front end's ``send``, which either
hands it to an event loop in this process (``create_app``) or writes it to a front-end process (``Server``,
one or ``api_server_count`` of them). No text, JSON or HTTP here.

Several front ends: every command arrives tagged with its front end's index (``put(command, source)``); the
loop remembers which front end added each request and sends its outputs, its ``Added`` and its failures to
that front end only (pool figures go to all). ``max_waiting`` is enforced here, over all front ends together.
A front end that stops (``StopEngine``) or goes away has its requests aborted; the loop ends once none is left.

The ``Engine`` is a handle on the model's one engine: other callers (``generate_many`` in another thread)
may share batches with the server's requests; ``step`` returns this handle's outputs only.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..engine import Engine, ModelUnpatched
from ..patch import patch
from ..patch import stats as pool_stats
from ..prompt_forms import UnpaddedIds
from .messages import (
    AbortRequests,
    Added,
    AddRequests,
    EngineDied,
    EngineStats,
    EngineStopped,
    FrontendGone,
    RequestsFailed,
    StepOutputs,
    StopEngine,
)
from .preparer import CommandPreparer
from .request_params import ModelLimits

logger = logging.getLogger("hfpaged.serve")

STATS_INTERVAL = 0.1  # seconds between pool figures shipped with step outputs (also sent whenever idle)
LOOP_PARTS = ("step", "commands", "outputs", "idle")  # where the engine thread's time goes (LoopClock)


def model_limits(model: Any) -> ModelLimits:
    """Context length, KV pool capacity and vocabulary size of a patched model."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_model_len = getattr(config, "max_position_embeddings", None)
    length_limit = getattr(getattr(model, "_hfpaged", None), "length_limit", None)  # hfpaged.model.attach
    if length_limit is not None:
        max_model_len = min(max_model_len or length_limit[0], length_limit[0])
    long_rope = getattr(getattr(model, "_hfpaged", None), "long_rope", None)
    short_prompts = long_rope.short_prompt_limit if long_rope is not None else None  # what LongRope.refusal allows
    stats = pool_stats(model)
    return ModelLimits(
        max_model_len=int(max_model_len) if max_model_len else None,
        max_pool_tokens=stats["num_blocks"] * stats["block_size"],
        vocab_size=model.get_input_embeddings().weight.shape[0],
        short_prompts=short_prompts,
    )


def served_model_name_of(model: Any, served_model_name: str | None) -> str:
    """The name clients pass as ``model``: the one given, else the model's path, else its class name."""
    return served_model_name or getattr(model, "name_or_path", None) or type(model).__name__


class LoopClock:
    """Seconds the engine thread spent per part of its loop: ``step`` (inside ``Engine.step``), ``commands``
    (taking commands off the queue, adds and aborts), ``outputs`` (packing and sending results, pool figures;
    a front end that reads too slowly shows up here) and ``idle`` (asleep with nothing to do; counted when it
    wakes). One ``perf_counter`` per part per iteration."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(LOOP_PARTS, 0.0)
        self.last = time.perf_counter()

    def lap(self, part: str) -> None:
        """The time since the previous lap was spent in ``part``."""
        now = time.perf_counter()
        self.seconds[part] += now - self.last
        self.last = now


class EngineLoop:
    """Runs ``Engine.step`` in a background thread; ``put`` commands, results leave through each front end's
    ``send``. ``max_waiting``: submissions added but without a token yet, at most (None: no bound)."""

    def __init__(self, model: Any, tokenizer: Any, *, max_waiting: int | None = None):
        if getattr(model, "_hfpaged", None) is None:
            patch(model, tokenizer=tokenizer)  # defaults, as generate_many would need
        self.model = model
        self.engine = Engine(model, tokenizer=tokenizer)
        self.max_waiting = max_waiting
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # (source, command)
        self.preparer = CommandPreparer(self.commands.put, model, tokenizer)
        self.clock = LoopClock()
        self.stats: dict[str, Any] = self._snapshot()  # the latest snapshot
        self.num_steps = 0
        self.unfinished: dict[str, int] = {}  # submission id -> sequences not finished yet
        self.owners: dict[str, int] = {}  # submission id -> the front end that added it
        self.waiting: set[str] = set()  # added, no token yet
        self.failed: BaseException | None = None
        self.sends: list[Callable[[Any], None]] = []
        self.open_sources: set[int] = set()  # front ends that have not stopped
        self.last_stats_time = 0.0
        self.thread = threading.Thread(target=self._run, name="hfpaged-engine-loop", daemon=True)

    def start(self, sends: Sequence[Callable[[Any], None]]) -> None:
        """Start the engine thread; front end ``i``'s messages go to ``sends[i]`` (which raises ``FrontendGone``
        once nobody listens there)."""
        if self.thread.is_alive():
            raise RuntimeError("this engine loop is running already: an app serves one lifespan at a time")
        if self.thread.ident is not None:  # it ran for an earlier lifespan of the app, and ended: a fresh thread
            self.thread = threading.Thread(target=self._run, name="hfpaged-engine-loop", daemon=True)
            self.failed = None
        self.sends = list(sends)
        self.open_sources = set(range(len(self.sends)))
        self.thread.start()

    def put(self, command: Any, source: int | None = 0) -> None:
        """Queue a command (``AddRequests``, ``AbortRequests``, ``StopEngine``) of front end ``source``;
        thread-safe. ``StopEngine`` with ``source=None`` stops the whole loop."""
        self.preparer.put((source, command))  # (in order, after what is slow to build: preparer.py)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and can take requests."""
        return self.thread.is_alive() and self.failed is None

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        clock = self.clock
        try:
            while True:
                if not self.open_sources:  # every front end stopped or went away
                    self._drain()
                    return
                commands = []
                engine = self._follow_repatch()
                if not engine.has_unfinished():
                    self._refresh_stats()
                    self._broadcast(EngineStats(self.stats))
                    clock.lap("outputs")
                    if not self.open_sources:  # the last one is gone
                        continue
                    commands.append(self.commands.get())  # sleep until there is work
                    clock.lap("idle")
                while True:
                    try:
                        commands.append(self.commands.get_nowait())
                    except queue.Empty:
                        break
                adds: list[tuple[int, AddRequests]] = []  # consecutive adds go to the engine together
                for source, command in commands:
                    if isinstance(command, AddRequests):
                        adds.append((source, command))
                        continue
                    self._add(adds)
                    adds = []
                    if isinstance(command, StopEngine):
                        self._stop(source)
                    elif isinstance(command, AbortRequests):
                        for request_id in command.request_ids:
                            if self.owners.get(request_id) == source:
                                self._abort(request_id)
                self._add(adds)
                clock.lap("commands")
                if self.open_sources and self.engine.has_unfinished():
                    self._step()
        except BaseException as exc:  # pragma: no cover - a bug: report it to every waiting request
            logger.exception("hfpaged engine loop died")
            self.failed = exc
            with contextlib.suppress(Exception):
                self._broadcast(EngineDied(f"the engine loop died: {exc!r}"))
            with contextlib.suppress(Exception):
                self._drain()

    def _current_engine(self) -> Any:
        """The model's engine now (None while it is not patched, or between the two halves of a patch)."""
        return getattr(getattr(self.model, "_hfpaged", None), "engine", None)

    def _follow_repatch(self) -> Engine:
        """The handle on the model's engine. Once the model is unpatched or patched again (other settings), the old
        handle's last outputs (its requests end with "abort") go out, what it leaves unreported fails (an n > 1
        prompt that had not forked yet), and, once the model has a new engine, the loop goes on with a handle on it."""
        engine = self._current_engine()
        old = self.engine
        if engine is old.core:
            return old
        if old.outbox:
            self._ship(old.step())
        self._fail_all("the model was unpatched or patched again while it ran")
        with contextlib.suppress(Exception):  # (unpatch ended them all under the engine's lock: what it left)
            old.abort_all()
        old.prompts.clear()  # nothing of the old handle is reported any more: the loop must not step it
        if engine is not None:
            with contextlib.suppress(ValueError, RuntimeError):  # unpatched again meanwhile: the next call retries
                self.engine = Engine(self.model, tokenizer=old.tokenizer)
                self._broadcast(EngineStats(self._refresh_stats()))  # the front ends' limits follow the new pool
        return self.engine

    def _send(self, source: int, message: Any) -> None:
        """Send to one front end; one that is gone is closed (its requests aborted) instead."""
        if source not in self.open_sources:
            return
        try:
            self.sends[source](message)
        except FrontendGone:
            logger.warning("hfpaged: front end %d is gone; aborting its requests", source)
            self._close(source)

    def _broadcast(self, message: Any) -> None:
        for source in sorted(self.open_sources):
            self._send(source, message)

    def _close(self, source: int) -> None:
        """Front end ``source`` takes no more messages: abort what it added."""
        self.open_sources.discard(source)
        self._abort_all_of(source)

    def _stop(self, source: int | None) -> None:
        """``StopEngine`` from front end ``source`` (None: from the server, for all): abort its requests and
        answer ``EngineStopped``; once no front end is left, drain the engine first."""
        stopping = sorted(self.open_sources) if source is None else [source] if source in self.open_sources else []
        for stopped in stopping:
            self._abort_all_of(stopped)
        if len(stopping) == len(self.open_sources):
            self._drain()
        for stopped in stopping:
            self._send(stopped, EngineStopped(self.stats))
            self.open_sources.discard(stopped)

    def _abort_all_of(self, source: int) -> None:
        for request_id in [rid for rid, owner in self.owners.items() if owner == source]:
            self._abort(request_id)

    def _add(self, commands: list[tuple[int, AddRequests]]) -> None:
        """Add the submissions of ``commands`` in one ``add_requests`` (the weights checked once for all); if
        that fails, command by command, so that each answers for its own (all or none each). A command that
        would take the waiting submissions (of all front ends) over ``max_waiting`` is refused (a 429)."""
        commands = self._admit(commands)
        if not commands:
            return
        if len(commands) > 1:
            try:
                self._add_submissions(commands)
            except Exception:  # one of them is bad: find out which, one command at a time
                pass
            else:
                for source, command in commands:
                    self._send(source, Added(command.tag, None))
                return
        for source, command in commands:
            error = None
            try:
                self._add_submissions([(source, command)])
            except Exception as exc:  # ValueError/TypeError: a bad setting; the handler answers 400
                kind = "unavailable" if isinstance(exc, (ModelUnpatched, ReferenceError)) else "error"  # (a 503)
                error = ("invalid" if isinstance(exc, (ValueError, TypeError)) else kind, str(exc))
            self._send(source, Added(command.tag, error))

    def _admit(self, commands: list[tuple[int, AddRequests]]) -> list[tuple[int, AddRequests]]:
        """The commands within ``max_waiting`` (in arrival order); the others are answered "queue_full"."""
        admitted = []
        num_waiting = len(self.waiting)
        for source, command in commands:
            if source not in self.open_sources:
                continue
            count = len(command.submissions)
            if self.max_waiting is not None and num_waiting + count > self.max_waiting:
                self._send(source, Added(command.tag, ("queue_full", f"{num_waiting} requests are waiting")))
                continue
            num_waiting += count
            admitted.append((source, command))
        return admitted

    def _add_submissions(self, commands: list[tuple[int, AddRequests]]) -> None:
        submissions = [(source, s) for source, command in commands for s in command.submissions]
        # every token is attended, as under an all-ones attention mask: a pad id in a request's text is a token
        args = ([UnpaddedIds(s.prompt_token_ids) for _, s in submissions], [s.generate_kwargs for _, s in submissions])
        for attempt in range(2):
            engine = self._follow_repatch()  # (a re-patch while the loop slept)
            try:
                engine.add_requests(*args, [s.request_id for _, s in submissions], name_prompts=False)
                break
            # re-patched since the line above (a stale handle: its checks raise either): once more, on the new one
            except (RuntimeError, ReferenceError):
                current = self._current_engine()
                if attempt or current is None or current is engine.core:
                    raise
        for source, submission in submissions:
            self.unfinished[submission.request_id] = submission.num_sequences
            self.owners[submission.request_id] = source
            self.waiting.add(submission.request_id)

    def _fail_all(self, message: str) -> None:
        """Every unfinished submission is aborted and fails with ``message`` (``RequestsFailed`` to its front end)."""
        by_source: dict[int, list[str]] = {}
        for request_id in list(self.unfinished):
            by_source.setdefault(self.owners.get(request_id), []).append(request_id)
            with contextlib.suppress(Exception):  # (a handle gone stale: its engine has ended them already)
                self.engine.abort(request_id)
            self.unfinished.pop(request_id, None)
            self.owners.pop(request_id, None)
            self.waiting.discard(request_id)
        for source, failed in by_source.items():
            if source is not None:
                self._send(source, RequestsFailed(failed, message))

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.unfinished.pop(request_id, None)
        self.owners.pop(request_id, None)
        self.waiting.discard(request_id)

    def _step(self) -> None:
        clock = self.clock
        try:
            outputs = self.engine.step()
        except Exception as exc:
            clock.lap("step")
            logger.exception("hfpaged engine step failed; aborting the requests in it")
            self._fail_all(f"the engine step failed: {exc!r}")
            clock.lap("outputs")
            return
        clock.lap("step")
        self.num_steps += 1
        self._ship(outputs)
        clock.lap("outputs")

    def _ship(self, outputs: list) -> None:
        """Send each front end its outputs of a step (and the pool figures, every STATS_INTERVAL)."""
        columns: dict[int, StepOutputs] = {}  # front end -> its outputs of this step
        unfinished, waiting, owners = self.unfinished, self.waiting, self.owners
        for output in outputs:
            request_id = output.prompt_id
            source = owners.get(request_id)
            if source is None:  # aborted meanwhile (or not the server's)
                continue
            waiting.discard(request_id)
            column = columns.get(source)
            if column is None:
                column = columns[source] = StepOutputs([], [], [], {}, {})
            k = len(column.prompt_ids)
            column.prompt_ids.append(request_id)
            column.sequence_indexes.append(output.sequence_index)
            column.new_token_ids.append(output.new_token_ids)
            if output.new_logprobs is not None:
                column.logprobs[k] = (output.new_logprobs, output.new_top_logprobs)
            if output.finished:
                column.finished[k] = (output.finish_reason or "stop", output.error)
                left = unfinished.get(request_id)
                if left is not None:
                    if left <= 1:
                        del unfinished[request_id]
                        del owners[request_id]
                    else:
                        unfinished[request_id] = left - 1
        if time.perf_counter() - self.last_stats_time >= STATS_INTERVAL:
            stats = self._refresh_stats()
            for source in self.open_sources:
                if source in columns:
                    columns[source].stats = stats
                else:
                    columns[source] = StepOutputs([], [], [], {}, {}, stats)
        for source, column in columns.items():
            self._send(source, column)

    def _snapshot(self) -> dict[str, Any]:
        """The pool figures (``hfpaged.stats``) and this loop's counters, as the front ends show them (the last
        figures while the model is not patched: between the two halves of a re-patch in another thread)."""
        try:
            stats = pool_stats(self.model)
        except (ValueError, AttributeError):  # mid re-patch (no pool, or no engine yet)
            stats = dict(getattr(self, "stats", {}))
        stats["engine_loop_seconds"] = dict(self.clock.seconds)
        stats["engine_loop_steps"] = getattr(self, "num_steps", 0)
        return stats

    def _refresh_stats(self) -> dict[str, Any]:
        self.stats = self._snapshot()
        self.last_stats_time = time.perf_counter()
        return self.stats

    def _drain(self) -> None:
        """Abort every unfinished request, then step until the engine holds nothing of ours in flight."""
        for request_id in list(self.unfinished):
            self._abort(request_id)
        for _ in range(1000):
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        self._refresh_stats()
