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

Several sequences of one prompt share blocks (``fork``, ``share_blocks``; ref counts in the pool); the
block a request is about to write into is copied on write when it is shared. The k beams of a beam
search group are admitted and preempted together, by recompute (see ``beam_search``): a group is either
wholly running or wholly waiting. A beam whose row of the current round is computed has no token to
compute, so it is simply not scheduled until its group has selected the next tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .config import EngineConfig
from .prefix_cache import PrefixCache
from .request import Request, RequestStatus
from .stopping import check_stops


COUNTER_NAMES = ("num_preemptions", "num_swapped_out", "prefix_cache_queries", "prefix_cache_hits")


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
        for key in COUNTER_NAMES:
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
        request.num_pending_tokens = 0  # a token still in flight is dropped

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

    def _preempt(self, request: Request, out: SchedulerOutput) -> list[Request]:
        """Preempt ``request``, or every beam of its group with it; returns the requests preempted."""
        group = request.beam_group
        if group is None:
            self._preempt_one(request, out, allow_swap=True)
            return [request]
        members = [m for m in group.members if m.status is RequestStatus.RUNNING]
        for member in reversed(members):  # back to the front of waiting together, in beam order
            self._preempt_one(member, out, allow_swap=False)
        group.forget_rows()
        return members

    def _cancel_copies(self, request: Request) -> list[int]:
        """The blocks that hold ``request``'s KV now, before it is released.

        A copy-on-write of this step into one of its blocks has not run yet: it is cancelled (its target
        goes back to the pool with the request, and may be handed out again this step), and the source
        of the copy stands in for the target.
        """
        if not self.pending_copies:
            return list(request.block_ids)
        owned = set(request.block_ids)
        source_of = {dst: src for src, dst in self.pending_copies if dst in owned}
        if not source_of:
            return list(request.block_ids)
        self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in source_of]
        return [source_of.get(block_id, block_id) for block_id in request.block_ids]

    def _preempt_one(self, request: Request, out: SchedulerOutput, allow_swap: bool) -> None:
        self.running.remove(request)
        out.preempted.append(request)
        gpu_ids = self._cancel_copies(request)
        if allow_swap and self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= len(request.block_ids):
            cpu_ids = self.cpu_pool.allocate(len(request.block_ids))
            out.swap_out.append((gpu_ids, cpu_ids))
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

        # A request whose pending token (sampled by the step still in flight) ends it by length is not
        # planned again: it finishes when that token is read back.
        decodes = [
            r for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1
            and not (r.num_pending_tokens and r.num_tokens >= r.params.max_length)
        ]
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
                for victim in self._preempt(self.running[-1], out):
                    undone = scheduled.pop(victim.request_id, None)
                    if undone is not None:  # give back what the victim was granted this step
                        budget += undone.num_tokens
                if request.status is not RequestStatus.RUNNING:
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
                if request.beam_group is not None and len(request.beam_group.members) > 1:
                    budget_left = self._admit_beams(request.beam_group.members, budget, scheduled)
                    if budget_left is None:
                        break
                    budget = budget_left
                    continue
                if len(self.running) + request.num_forks_pending >= self.config.max_num_seqs:
                    break  # the sequences it forks into at its first sample would not fit
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

    def _admit_beams(self, members: list[Request], budget: int, scheduled: dict[str, ScheduledRequest]) -> int | None:
        """Admit all the beams of a re-queued group, or none; returns the token budget left (None: none).

        All their blocks must fit above the watermark; beams past the token budget join without tokens
        this step and are prefilled in the next ones.
        """
        if len(self.running) + len(members) > self.config.max_num_seqs:
            return None
        keep_free = self.watermark_blocks if self.running else 0
        if self.pool.num_free_blocks - sum(-(-m.num_tokens // self.block_size) for m in members) < keep_free:
            return None
        for member in members:
            num_new = self._admit(member, budget, 0) if budget > 0 else 0
            self.waiting.remove(member)
            member.status = RequestStatus.RUNNING
            self.running.append(member)
            if num_new:
                scheduled[member.request_id] = ScheduledRequest(member, member.num_computed_tokens, num_new)
                budget -= num_new
        return budget

    def fork(self, child: Request, parent: Request) -> None:
        """``child`` shares ``parent``'s KV (one more reference on each block) and progress, and starts running.

        Their common last block, if partly filled, is copied on write by whichever writes into it first.
        """
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def share_blocks(self, targets: list[Request], sources: list[Request]) -> None:
        """Each ``targets[j]`` takes over the KV and progress of ``sources[j]`` (beam search: beam j continues it).

        The new references are taken before the targets' old blocks are released, so a block some target
        keeps is never freed in between; blocks no target keeps return to the pool.
        """
        taken = [(list(s.block_ids), s.num_computed_tokens, list(s.block_hashes), s.num_registered_blocks) for s in sources]
        for block_ids, _, _, _ in taken:
            self.pool.incref(block_ids)
        for target, (block_ids, num_computed, hashes, num_registered) in zip(targets, taken):
            self.pool.free(target.block_ids)
            target.block_ids = block_ids
            target.num_computed_tokens = num_computed
            target.block_hashes = hashes
            target.num_registered_blocks = num_registered

    def advance(self, out: SchedulerOutput) -> None:
        """Count the tokens a launched step computes; publish blocks that became full to the prefix cache.

        Requests finished since the step was scheduled (stopped by the token of the step before, or
        aborted) are skipped: their blocks are already back in the pool.
        """
        for item in out.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.num_computed_tokens += item.num_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.register(request)

    def append_tokens(
        self, requests: list[Request], token_ids: list[int], forks: dict[str, list[Request]] | None = None
    ) -> list[Request]:
        """Append each request's sampled token and finish those that stop; finished requests are skipped.

        ``forks`` (parallel sampling) names, by parent id, the children that fork off a parent as it gains
        its first token; their tokens are among ``requests``/``token_ids`` too. Returns the requests that
        gained a token (finished ones included).
        """
        children = {c.request_id for group in forks.values() for c in group} if forks else ()
        sampled = dict(zip((r.request_id for r in requests), token_ids))
        advanced = []
        for request, token_id in zip(requests, token_ids):
            if request.is_finished or request.request_id in children:
                continue
            request.append_token(token_id)
            advanced.append(request)
            if forks:
                for child in forks.get(request.request_id, ()):
                    self.fork(child, request)
                    child.append_token(sampled[child.request_id])
                    advanced.append(child)
        for request, reason in zip(advanced, check_stops(advanced)):
            if reason is not None:
                self.finish(request, reason)
        return advanced

    def update(
        self, out: SchedulerOutput, sampled: dict[str, int], forks: dict[str, list[Request]] | None = None
    ) -> list[Request]:
        """``advance`` then ``append_tokens`` for a step whose tokens (by request id) are already known.

        Children forking off a parent (``forks``) are named in ``sampled`` by their own ids.
        """
        self.advance(out)
        requests = [item.request for item in out.scheduled if item.request.request_id in sampled]
        for group in (forks or {}).values():
            requests += group
        return self.append_tokens(requests, [sampled[r.request_id] for r in requests], forks)
