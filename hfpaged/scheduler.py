"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Policy (vLLM v1's framing, no separate prefill/decode phases):
1. running requests, decodes first (then running chunked prefills), oldest admitted first; each
   gets ``min(tokens behind, budget left)`` tokens. When one cannot get a block, the most recently
   admitted running request is preempted (by recompute: blocks freed, back to the front of waiting)
   until it can - possibly itself;
2. then waiting requests in order, while ``max_num_seqs`` and the token budget allow and their
   blocks fit above the watermark (no admissions in a step that preempted).
A request is sampled only in a step that brings it fully up to date.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .block_pool import BlockPool
from .config import EngineConfig
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens when scheduled: position of the first token this step
    num_tokens: int  # tokens computed this step
    samples: bool = False  # this step brings the request up to date: its last logits are sampled

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one shared block pool."""

    def __init__(self, config: EngineConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.watermark_blocks = int(config.watermark * pool.num_blocks)

    # --- queue management -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark ``request`` finished, release its blocks and drop it from the queues."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def _try_reserve(self, request: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Give ``request`` blocks for its first ``num_tokens`` positions if the pool has them."""
        needed = self._blocks_needed(request, num_tokens)
        if needed == 0:
            return True
        if self.pool.num_free_blocks - needed < keep_free:
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # --- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; allocates the blocks it needs."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}

        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            while True:
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if self._try_reserve(request, request.num_computed_tokens + num_new):
                    break
                victim = self.running[-1]
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:  # give back what the victim was granted this step
                    budget += undone.num_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
            budget -= num_new

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                keep_free = self.watermark_blocks if self.running else 0
                if not self._try_reserve(request, request.num_computed_tokens + num_new, keep_free):
                    break
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
                budget -= num_new

        out.scheduled = list(scheduled.values())
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens; finish those that stop.

        Returns the requests that gained a token this step (finished ones included).
        """
        advanced = []
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue
            request.append_token(token_id)
            advanced.append(request)
            reason = self.check_stop(request)
            if reason is not None:
                self.finish(request, reason)
        return advanced

    def check_stop(self, request: Request) -> str | None:
        """``"stop"`` (eos / stop criteria), ``"length"`` (max_length), or None."""
        params = request.params
        if request.all_token_ids[-1] in params.eos_token_ids:
            return "stop"
        if params.stopping_criteria is not None:
            ids = torch.tensor([request.all_token_ids], dtype=torch.long)
            if bool(params.stopping_criteria(ids, None).any()):
                return "stop"
        if request.num_tokens >= params.max_length:
            return "length"
        return None
