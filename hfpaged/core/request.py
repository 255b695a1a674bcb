"""Scheduler-side state of one sequence: its tokens, its progress through them, and its status."""

from __future__ import annotations

import enum
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..sampling.beam_search import BeamSearch
    from ..sampling.params import RequestParams


# the prefix-cache salt of a request whose keys a longrope model rotates long at every position (model/long_rope.py)
LONG_ROPE_SALT = "longrope:long"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV parked in CPU swap space
    FINISHED = "finished"


class RequestGroup:
    """The sequences of one prompt decoded side by side: parallel samples, or the beams of a beam search.

    The first member (the root) prefills the prompt; the others fork off it when it samples its first token.
    The root owns its group and the group its other members; their references back are weak, so that a prompt
    leaves no reference cycle behind: all of it goes with its root (which its caller and the engine hold).
    """

    def __init__(self, root: Request, num_sequences: int, beam_search: BeamSearch | None = None):
        self.members = [root]
        self.num_sequences = num_sequences
        self.beam_search = beam_search
        root.group = self
        root.num_forks_pending = num_sequences - 1

    @property
    def root(self) -> Request | None:
        return self._root()

    @property
    def members(self) -> list[Request]:
        """Every sequence of the prompt, its root first (a new list)."""
        return [self._root(), *self._others]

    @members.setter
    def members(self, members: list[Request]) -> None:
        self._root, self._others = weakref.ref(members[0]), list(members[1:])

    def add_member(self, request_id: str, params: RequestParams, sequence_index: int) -> Request:
        """A new sequence of the group's prompt, forking off its first request."""
        root = self._root()
        member = Request(request_id, root.prompt_token_ids, params, index=root.index)
        member.prompt_id = root.prompt_id
        member.group = self
        member.sequence_index = sequence_index
        member.arrival_time = root.arrival_time
        member.stream_outputs = root.stream_outputs
        member.cache_salt = root.cache_salt
        member.restart_past = root.restart_past
        self._others.append(member)
        return member


class Request:
    """One sequence being decoded.

    A request is simply behind by ``num_tokens - num_computed_tokens`` tokens: the whole prompt before its
    first step, one token while decoding, everything again after a recompute preemption. Only the scheduler
    changes it after creation.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: RequestParams,
        index: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_id = request_id  # the id of its prompt's first request (its own, unless it was forked)
        self.index = index  # position in the caller's prompt list, when there is one
        self.added_depth = 0  # engine steps under way when it was added (> 0: by a call nested in a step)
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it finished with finish_reason "error"
        self.exception: BaseException | None = None  # what its own callback (processor, criterion) raised
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.logprobs: list[float] | None = [] if params.return_logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs else None
        # Several sequences per prompt: the group, this sequence's place in it, and (root, before its first
        # sample) how many sequences it forks off then. None / 0 for the usual single sequence.
        self.group = None
        self.sequence_index = 0
        self.num_forks_pending = 0
        # Tokens sampled by an overlapped step whose values the host has not read yet: they count in
        # num_tokens (the next step is planned with them) and become real in update_from_output.
        self.num_output_placeholders = 0
        # whether each step's new tokens are handed to the caller; False (generate_many without a streamer or
        # progress bar): only the finished request's output, with all its tokens
        self.stream_outputs = True
        # prefix-cache blocks are shared only between requests of the same salt (None: the unsalted chain)
        self.cache_salt: str | None = None
        # a longrope model whose generate recomputes a sequence long once it grows past this many tokens (Phi-3, or
        # generate(use_cache=False); model/long_rope.py): the scheduler computes it again there, salted
        self.restart_past: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def group(self) -> RequestGroup | None:
        group = self._group
        return group() if isinstance(group, weakref.ref) else group

    @group.setter
    def group(self, group: RequestGroup | None) -> None:
        # the root holds its group; the group holds its other members, which refer back to it weakly (no cycle)
        self._group = group if group is None or group.root is self else weakref.ref(group)

    @property
    def beam_search(self) -> BeamSearch | None:
        """The beam search this request is a beam of, if any."""
        return self.group.beam_search if self.group is not None else None

    @property
    def members(self) -> list[Request]:
        """Every sequence of this request's prompt (itself alone unless it is part of a group)."""
        return self.group.members if self.group is not None else [self]

    def append_token(self, token_id: int, logprob: float | None = None, top_logprobs: dict | None = None) -> None:
        """Append a sampled token (and its log-probabilities when the request keeps them)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.all_token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
            if self.top_logprobs is not None:
                self.top_logprobs.append(top_logprobs if top_logprobs is not None else {})

    def pop_token(self) -> None:
        """Undo the last ``append_token`` (an update that failed before stop-checking it: the token is sampled again)."""
        self.all_token_ids.pop()
        if self.logprobs is not None and len(self.logprobs) > len(self.all_token_ids) - self.num_prompt_tokens:
            self.logprobs.pop()
            if self.top_logprobs is not None:
                self.top_logprobs.pop()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )


def is_prompt_finished(root: Request) -> bool:
    """Whether every sequence of the prompt whose first request is ``root`` has finished."""
    return root.num_forks_pending == 0 and all(m.is_finished for m in root.members)
