"""What the runner hands back for one step: the sampled tokens, read by ``Scheduler.update_from_output``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampling.params import RequestParams


@dataclass
class SampledToken:
    """One row's pick, with its log-probability (and top alternatives) when the request asked."""

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    error: str | None = None  # the row could not be sampled (NaN/inf probabilities): the token is meaningless


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


@dataclass
class ModelRunnerOutput:
    sampled: list[SampledToken] = field(default_factory=list)  # in row order
    forks: dict[str, list[ForkedSample]] = field(default_factory=dict)  # by parent request id
    beam_rounds: list[BeamRound] = field(default_factory=list)
