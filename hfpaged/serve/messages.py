"""What the engine side and the HTTP front end say to each other: small, picklable messages.

The engine side (the process that holds the model, one thread) takes commands (``AddRequests``,
``AbortRequests``, ``StopEngine``) and answers with ``Added`` once per add, one ``StepOutputs`` per engine
step that produced tokens, ``RequestsFailed`` when a step fails, ``EngineStats`` when it goes idle and
``EngineStopped`` when it has drained. Token ids travel as ids: detokenization, JSON and HTTP belong to the
front end. The same messages run through an in-process link (``create_app``) or a socket between two
processes (``Server``, see ``frontend_process``); nothing here imports torch or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .request_params import ModelLimits


class EngineFailure(Exception):
    """The engine failed while running a request (a bug, or the server stopped under it)."""


class FrontendGone(Exception):
    """The engine side's ``send`` cannot reach the front end any more (its process or event loop ended)."""


@dataclass
class Submission:
    """One engine request: a prompt and its generate settings (``num_sequences`` > 1 for parallel samples)."""

    request_id: str
    prompt_token_ids: list[int]
    generate_kwargs: dict[str, Any]
    num_sequences: int = 1


class TokenDelta(NamedTuple):
    """What one sequence of a submission gained in one engine step (a compact ``RequestOutput``)."""

    prompt_id: str  # the submission's request id
    sequence_index: int  # which of its ``num_sequences``
    new_token_ids: list[int]
    finish_reason: str | None  # None while it runs: "stop", "length", "time", "abort" or "error" once it ends
    error: str | None = None  # with finish_reason "error": what went wrong
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# --- front end -> engine ----------------------------------------------------------------------------


@dataclass
class AddRequests:
    """Add these submissions (all or none); answered by ``Added`` with the same ``tag``."""

    tag: int
    submissions: list[Submission]


@dataclass
class AbortRequests:
    """Stop these submissions now and free their blocks (no answer; their outputs stop coming)."""

    request_ids: list[str]


@dataclass
class StopEngine:
    """The front end is done: abort what it left, answer ``EngineStopped``; the engine loop ends with the last one
    (draining the step in flight first)."""


# --- engine -> front end ----------------------------------------------------------------------------


@dataclass
class Added:
    """The answer to ``AddRequests``: ``error`` is None, or (kind, message) with kind "invalid" (a bad setting:
    the engine's ValueError/TypeError, a 400), "queue_full" (``max_waiting`` over all front ends, a 429),
    "unavailable" (the model unpatched, or mid re-patch, a 503) or "error" (anything else, a 500)."""

    tag: int
    error: tuple[str, str] | None = None


@dataclass
class StepOutputs:
    """Everything one engine step produced, in columns (a few lists pickle far faster than many small objects):
    output k is sequence ``sequence_indexes[k]`` of submission ``prompt_ids[k]``, which gained
    ``new_token_ids[k]``; and now and then the pool figures (``hfpaged.stats``)."""

    prompt_ids: list[str]
    sequence_indexes: list[int]
    new_token_ids: list[list[int]]
    finished: dict[int, tuple[str, str | None]]  # k -> (finish reason, error) for the outputs that ended
    logprobs: dict[int, tuple[list[float], list[dict[int, float]] | None]]  # k -> log-probs, where asked for
    stats: dict[str, Any] | None = None

    def deltas(self) -> list[TokenDelta]:
        """The outputs one by one."""
        finished, logprobs = self.finished, self.logprobs
        return [
            TokenDelta(
                prompt_id, sequence_index, token_ids, *finished.get(k, (None, None)), *logprobs.get(k, (None, None))
            )
            for k, (prompt_id, sequence_index, token_ids) in enumerate(
                zip(self.prompt_ids, self.sequence_indexes, self.new_token_ids)
            )
        ]


@dataclass
class RequestsFailed:
    """The engine failed these submissions (a step raised); they are aborted and their blocks free."""

    request_ids: list[str]
    message: str


@dataclass
class EngineStats:
    """The pool figures, sent when the engine goes idle (so ``/metrics`` shows the resting state)."""

    stats: dict[str, Any]


@dataclass
class EngineStopped:
    """The engine loop ended after ``StopEngine`` (or lost its front end): nothing is in flight any more."""

    stats: dict[str, Any]


@dataclass
class EngineDied:
    """The engine loop itself failed (a bug): every request in flight fails, no new one is accepted."""

    message: str


# --- the server process <-> the front-end process -----------------------------------------------------


@dataclass
class FrontendConfig:
    """Everything the front-end process needs, sent once when it starts."""

    tokenizer: bytes  # pickled; loaded once ``sys_path`` is in place (a tokenizer class may live in user code)
    sys_path: list[str]
    model_name: str
    limits: ModelLimits
    stats: dict[str, Any]  # the pool figures at start
    max_waiting: int
    shutdown_timeout: float
    log_level: str
    http_fd: int  # the listening socket, bound by the server process and inherited
    api_server_index: int = 0  # which of the server's front-end processes this is
    metrics_dir: str | None = None  # with several front ends: their shared PROMETHEUS_MULTIPROC_DIR


@dataclass
class FrontendReady:
    """Front end -> server process: uvicorn accepts connections."""


@dataclass
class Shutdown:
    """Server process -> front end: stop gracefully (in-flight requests get ``shutdown_timeout``)."""
