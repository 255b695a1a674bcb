"""The engine side of a server: one thread, beside the model, that runs ``Engine.step`` and ships token ids.

It lives in the process that holds the model and does nothing but engine work: commands (``messages``)
come in on a thread-safe queue, are applied between steps (adds, aborts), the thread steps while anything
is unfinished and sleeps on the queue otherwise (no busy polling). Each step's outputs leave as one
``StepOutputs`` message of ``TokenDelta``s through ``send``, which either hands it to an event loop in this
process (``create_app``) or writes it to the front-end process (``Server``). No text, JSON or HTTP here.

The ``Engine`` is a handle on the model's one engine: other callers (``generate_many`` in another thread)
may share batches with the server's requests; ``step`` returns this handle's outputs only.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine import Engine
from ..patch import patch
from ..patch import stats as pool_stats
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
from .request_params import ModelLimits

logger = logging.getLogger("hfpaged.serve")

STATS_INTERVAL = 0.1  # seconds between pool figures shipped with step outputs (also sent whenever idle)


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


def served_model_name_of(model: Any, served_model_name: str | None) -> str:
    """The name clients pass as ``model``: the one given, else the model's path, else its class name."""
    return served_model_name or getattr(model, "name_or_path", None) or type(model).__name__


class EngineLoop:
    """Runs ``Engine.step`` in a background thread; ``put`` commands, results leave through ``send``."""

    def __init__(self, model: Any, tokenizer: Any):
        if getattr(model, "_hfpaged", None) is None:
            patch(model, tokenizer=tokenizer)  # defaults, as generate_many would need
        self.model = model
        self.engine = Engine(model, tokenizer=tokenizer)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.stats: dict[str, Any] = pool_stats(model)  # the latest snapshot
        self.num_steps = 0
        self.unfinished: dict[str, int] = {}  # submission id -> sequences not finished yet
        self.waiting: set[str] = set()  # added, no token yet
        self.failed: BaseException | None = None
        self.send: Callable[[Any], None] | None = None
        self.last_stats_time = 0.0
        self.thread = threading.Thread(target=self._run, name="hfpaged-engine-loop", daemon=True)

    def start(self, send: Callable[[Any], None]) -> None:
        """Start the engine thread; every message for the front end goes to ``send`` (raises ``FrontendGone``
        once nobody listens)."""
        self.send = send
        self.thread.start()

    def put(self, command: Any) -> None:
        """Queue a command (``AddRequests``, ``AbortRequests``, ``StopEngine``); thread-safe."""
        self.commands.put(command)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and can take requests."""
        return self.thread.is_alive() and self.failed is None

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                commands = []
                if not engine.has_unfinished():
                    self._refresh_stats()
                    self.send(EngineStats(self.stats))
                    commands.append(self.commands.get())  # sleep until there is work
                while True:
                    try:
                        commands.append(self.commands.get_nowait())
                    except queue.Empty:
                        break
                adds: list[AddRequests] = []  # consecutive adds go to the engine together
                for command in commands:
                    if isinstance(command, AddRequests):
                        adds.append(command)
                        continue
                    self._add(adds)
                    adds = []
                    if isinstance(command, StopEngine):
                        self._drain()
                        self.send(EngineStopped(self.stats))
                        return
                    if isinstance(command, AbortRequests):
                        for request_id in command.request_ids:
                            self._abort(request_id)
                self._add(adds)
                if engine.has_unfinished():
                    self._step()
        except FrontendGone:
            logger.warning("hfpaged: the front end is gone; aborting its requests")
            self._drain()
        except BaseException as exc:  # pragma: no cover - a bug: report it to every waiting request
            logger.exception("hfpaged engine loop died")
            self.failed = exc
            with contextlib.suppress(Exception):
                self.send(EngineDied(f"the engine loop died: {exc!r}"))
            with contextlib.suppress(Exception):
                self._drain()

    def _add(self, commands: list[AddRequests]) -> None:
        """Add the submissions of ``commands`` in one ``add_requests`` (the weights checked once for all); if
        that fails, command by command, so that each answers for its own (all or none each)."""
        if not commands:
            return
        if len(commands) > 1:
            try:
                self._add_submissions([s for command in commands for s in command.submissions])
            except Exception:  # one of them is bad: find out which, one command at a time
                pass
            else:
                for command in commands:
                    self.send(Added(command.tag, None))
                return
        for command in commands:
            error = None
            try:
                self._add_submissions(command.submissions)
            except Exception as exc:  # ValueError/TypeError: a bad setting; the handler answers 400
                error = ("invalid" if isinstance(exc, (ValueError, TypeError)) else "error", str(exc))
            self.send(Added(command.tag, error))

    def _add_submissions(self, submissions: list) -> None:
        self.engine.add_requests(
            [s.prompt_token_ids for s in submissions],
            [s.generate_kwargs for s in submissions],
            [s.request_id for s in submissions],
        )
        for submission in submissions:
            self.unfinished[submission.request_id] = submission.num_sequences
            self.waiting.add(submission.request_id)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.unfinished.pop(request_id, None)
        self.waiting.discard(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("hfpaged engine step failed; aborting the requests in it")
            failed = list(self.unfinished)
            for request_id in failed:
                self._abort(request_id)
            self.send(RequestsFailed(failed, f"the engine step failed: {exc!r}"))
            return
        self.num_steps += 1
        prompt_ids, sequence_indexes, new_token_ids, finished, logprobs = [], [], [], {}, {}
        unfinished, waiting = self.unfinished, self.waiting
        for k, output in enumerate(outputs):
            request_id = output.prompt_id
            waiting.discard(request_id)
            prompt_ids.append(request_id)
            sequence_indexes.append(output.sequence_index)
            new_token_ids.append(output.new_token_ids)
            if output.new_logprobs is not None:
                logprobs[k] = (output.new_logprobs, output.new_top_logprobs)
            if output.finished:
                finished[k] = (output.finish_reason or "stop", output.error)
                left = unfinished.get(request_id)
                if left is not None:
                    if left <= 1:
                        del unfinished[request_id]
                    else:
                        unfinished[request_id] = left - 1
        stats = None
        if time.perf_counter() - self.last_stats_time >= STATS_INTERVAL:
            stats = self._refresh_stats()
        if outputs or stats is not None:
            self.send(StepOutputs(prompt_ids, sequence_indexes, new_token_ids, finished, logprobs, stats))

    def _refresh_stats(self) -> dict[str, Any]:
        self.stats = pool_stats(self.model)
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
