"""What the scheduler hands the runner each step: plain data, no scheduler objects.

The runner keeps its own state per request (tokens, block table) between steps: a request it has not seen,
or whose state the scheduler replaced (resumed after preemption, a forked sample, a beam continuing
another), arrives whole in ``new_requests``; a request it holds arrives as a block-table diff in
``cached_requests`` (only when its table changed); ``dropped_ids`` names the requests it can forget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..outputs import RequestOutput
    from ..sampling.params import RequestParams
    from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step."""

    request_id: str
    start: int  # its num_computed_tokens when scheduled: position of its first token this step
    num_tokens: int  # tokens computed this step
    samples: bool  # this step brings it up to date: its last logits are sampled
    request: Request | None = None  # the request object (an id may be reused once its request has finished)


@dataclass
class NewRequestData:
    """Everything the runner needs to (re)build a request's state."""

    request_id: str
    token_ids: list[int]  # every known token (prompt and output)
    block_ids: list[int]
    params: RequestParams
    num_prompt_tokens: int
    sequence_index: int = 0  # its place among its prompt's sequences (beam slot, sample index)
    num_forks: int = 0  # parallel sampling: the other sequences it forks into at its first sample
    beam_search: Any = None  # sampling.beam_search.BeamSearch of its group, for beam members
    cache_salt: str | None = None  # Request.cache_salt (a longrope model's runner reads it: long at every position)

    @classmethod
    def of(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        """A copy of what the runner needs of ``request`` now."""
        return cls(
            request.request_id,
            list(request.all_token_ids),
            list(block_ids),
            request.params,
            request.num_prompt_tokens,
            request.sequence_index,
            request.num_forks_pending,
            request.beam_search,
            request.cache_salt,
        )


@dataclass(slots=True)
class CachedRequestData:
    """A block-table diff: the table from ``start`` on is now ``block_ids``."""

    request_id: str
    start: int
    block_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)  # finished, preempted or replaced since the last step
    preempted_ids: list[str] = field(default_factory=list)  # preempted in this step (a subset of dropped_ids)
    # block copies the runner performs before the forward: (gpu ids -> cpu ids), (cpu ids -> gpu ids), (src, dst)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # whether the next step may be scheduled before this one's tokens are read (its sampled tokens count as
    # placeholders until then)
    overlapped: bool = False
    nested: bool = False  # run inside another step of the engine (core/preemption.py): eager, not overlapped
    failed: list[RequestOutput] = field(default_factory=list)  # of requests failed in scheduling (core/preemption.py)

    @property
    def num_batched_tokens(self) -> int:
        return sum([s.num_tokens for s in self.scheduled])

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
