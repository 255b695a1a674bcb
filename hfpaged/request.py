"""Per-request state: tokens, progress through them, and the block table."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from .params import RequestParams

if TYPE_CHECKING:
    from .beam_search import BeamGroup
    from .parallel_sampling import SampleGroup


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV parked in CPU swap space
    FINISHED = "finished"


class Request:
    """One prompt being decoded.

    A request is simply behind by ``num_tokens - num_computed_tokens`` tokens: the whole prompt
    before its first step, one token while decoding, everything again after a recompute preemption.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: RequestParams, index: int | None = None):
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.cpu_block_ids: list[int] = []  # where its KV sits while swapped out
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids (prefix cache)
        self.num_registered_blocks = 0  # leading blocks published to the prefix cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.user_data: Any = None
        self.logprobs: list[float] | None = [] if params.return_logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs else None
        # Several sequences per prompt (see parallel_sampling / beam_search); None and 0 for the usual one.
        self.sample_group: SampleGroup | None = None
        self.beam_group: BeamGroup | None = None
        self.sequence_index = 0  # which of its prompt's sequences it is (parallel sampling), or its beam's slot
        self.num_forks_pending = 0  # sequences it forks off at its first sample (they count toward max_num_seqs)
        # Overlapped steps (engine): a token sampled on the device whose value the host has not read yet. It
        # counts in num_tokens (the scheduler plans the next step with it) but is not in all_token_ids; the
        # next step's input reads it on the device, from row pending_row of the previous step's tokens.
        self.num_pending_tokens = 0
        self.pending_row = -1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a sampled token (it replaces the pending token, if the step that sampled it ran overlapped)."""
        self.num_pending_tokens = 0
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.all_token_ids.append(token_id)

    def record_logprob(self, logprob: float, top: dict[int, float] | None) -> None:
        """Keep the log-probability of the token being appended (and its top alternatives, if asked)."""
        self.logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top if top is not None else {})

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_ids}, status={self.status.value})"
        )
