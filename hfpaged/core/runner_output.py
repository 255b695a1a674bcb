"""What the runner hands back for one step: the sampled tokens, read by ``Scheduler.update_from_output``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampling.params import RequestParams


@dataclass
class SampledToken:
    """One pick, with its log-probability (and top alternatives) when the request asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class ForkedSample:
    """A sequence forked off a parent at the parent's first sample (parallel sampling)."""

    sequence_index: int
    params: RequestParams
    sampled: SampledToken


@dataclass
class BeamRound:
    """A beam search group's selection after a round: beam j continues beam ``parents[j]`` with ``tokens[j]``."""

    root_id: str
    parents: list[int]
    tokens: list[int]
    unfinished: bool
    error: BaseException | None = None  # the group's processors or criteria raised: the search ends with it


@dataclass
class ModelRunnerOutput:
    """The step's picks, one row per sampled request (columns: cheap to build and read for many rows)."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None  # per row, when some request of the step asked
    top_logprobs: list[dict[int, float] | None] | None = None
    # rows that could not be sampled (NaN/inf probabilities), by request id: their token is meaningless
    # rows whose own processors raised: the exception (it fails that request only, not the step)
    errors: dict[str, str | BaseException] = field(default_factory=dict)
    forks: dict[str, list[ForkedSample]] = field(default_factory=dict)  # by parent request id
    beam_rounds: list[BeamRound] = field(default_factory=list)
