"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Policy (vLLM v1's framing, no separate prefill/decode phases):
1. running requests, decodes first (then running chunked prefills), oldest admitted first; each
   gets ``min(tokens behind, budget left)`` tokens. When one cannot get a block, the most recently
   admitted running request is preempted until it can - possibly itself. Preemption is by
   recompute (blocks freed, back to the front of waiting) or, in swap mode while CPU swap space
   has room, by swapping its blocks out (it keeps its progress and waits in the swapped queue);
2. then swapped requests, then waiting ones, in order, while ``max_num_seqs`` and the token budget
   allow and their blocks fit above the watermark (nothing joins in a step that preempted).
A request is sampled only in a step that brings it fully up to date.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .config import EngineConfig
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus
from .stopping import check_stops


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
    # block copies the runner performs before the forward: (gpu ids -> cpu ids) and (cpu ids -> gpu ids)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write: (src, dst) block ids

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one shared block pool."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        counters: dict[str, int] | None = None,
        cpu_pool: BlockPool | None = None,
    ):
        self.config = config
        self.pool = pool
        self.cpu_pool = cpu_pool if config.preemption_mode == "swap" else None
        self.block_size = config.block_size
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) blocks for the next step
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.watermark_blocks = int(config.watermark * pool.num_blocks)
        self.prefix_cache = PrefixCache(pool, config.block_size) if config.enable_prefix_caching else None
        # shared figures (hfpaged.stats): the engine passes the model's counters dict
        self.counters = counters if counters is not None else {}
        for key in ("num_preemptions", "num_swapped_out", "prefix_cache_queries", "prefix_cache_hits"):
            self.counters.setdefault(key, 0)

    # --- queue management -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request, reason: str) -> None:
        """Mark ``request`` finished, release its blocks and drop it from the queues."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
            self.cpu_pool.free(request.cpu_block_ids)
            request.cpu_block_ids = []
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _release(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
        request.num_registered_blocks = 0

    def _admit(self, request: Request, budget: int, keep_free: int) -> int:
        """Reserve blocks for a waiting request's next chunk, reusing cached prefix blocks.

        Returns the number of tokens to compute this step (0: it does not fit now).
        """
        hits = self.prefix_cache.find_hits(request) if self.prefix_cache is not None else []
        num_cached = len(hits) * self.block_size
        num_new = min(request.num_tokens - num_cached, budget)
        needed = -(-(num_cached + num_new) // self.block_size) - len(hits)
        revived = sum(1 for block_id in hits if self.pool.ref_counts[block_id] == 0)
        if self.pool.num_free_blocks - revived - needed < keep_free:
            return 0
        self.pool.incref(hits)
        request.block_ids = hits + self.pool.allocate(needed)
        request.num_computed_tokens = num_cached
        request.num_registered_blocks = len(hits)
        if self.prefix_cache is not None:
            self.counters["prefix_cache_queries"] += request.num_tokens
            self.counters["prefix_cache_hits"] += num_cached
        return num_new

    def _blocks_needed(self, request: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(request.block_ids))

    def _try_reserve(self, request: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Give ``request`` blocks for its first ``num_tokens`` positions if the pool has them.

        The block that the next computed token lands in must be the request's own: if it is shared
        (a fork: parallel samples, beams) it is copied on write first.
        """
        needed = self._blocks_needed(request, num_tokens)
        write_index = request.num_computed_tokens // self.block_size
        shared = write_index < len(request.block_ids) and self.pool.ref_counts[request.block_ids[write_index]] > 1
        if needed + shared == 0:
            return True
        if self.pool.num_free_blocks - needed - shared < keep_free:
            return False
        if shared:
            old = request.block_ids[write_index]
            (new,) = self.pool.allocate(1)
            self.pending_copies.append((old, new))
            request.block_ids[write_index] = new
            self.pool.free([old])
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        out.preempted.append(request)
        if self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= len(request.block_ids):
            cpu_ids = self.cpu_pool.allocate(len(request.block_ids))
            out.swap_out.append((list(request.block_ids), cpu_ids))
            request.cpu_block_ids = cpu_ids
            self._release(request)
            request.status = RequestStatus.SWAPPED
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.counters["num_preemptions"] += 1
            self.counters["num_swapped_out"] += 1
            self.swapped.append(request)
            return
        self._release(request)  # recompute (also the fallback when swap space is full)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.counters["num_preemptions"] += 1
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
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
            budget -= num_new

        if not out.preempted:
            while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.swapped[0]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                needed = max(-(-(request.num_computed_tokens + num_new) // self.block_size), len(request.cpu_block_ids))
                keep_free = self.watermark_blocks if self.running else 0
                if self.pool.num_free_blocks - needed < keep_free:
                    break
                self.swapped.popleft()
                request.block_ids = self.pool.allocate(needed)
                out.swap_in.append((request.cpu_block_ids, request.block_ids[: len(request.cpu_block_ids)]))
                self.cpu_pool.free(request.cpu_block_ids)  # the copy runs before any later swap-out
                request.cpu_block_ids = []
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
                budget -= num_new
        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                keep_free = self.watermark_blocks if self.running else 0
                num_new = self._admit(request, budget, keep_free)
                if num_new == 0:
                    break
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled[request.request_id] = ScheduledRequest(request, request.num_computed_tokens, num_new)
                budget -= num_new

        out.scheduled = list(scheduled.values())
        out.block_copies, self.pending_copies = self.pending_copies, []
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens; finish those that stop.

        Returns the requests that gained a token this step (finished ones included).
        """
        advanced = []
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.register(request)
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue
            request.append_token(token_id)
            advanced.append(request)
        for request, reason in zip(advanced, check_stops(advanced)):
            if reason is not None:
                self.finish(request, reason)
        return advanced

    def check_stop(self, request: Request) -> str | None:
        """``"stop"`` (eos / stop strings / criteria), ``"length"`` (max_length), ``"time"`` (max_time), or None."""
        return check_stops([request])[0]
