"""Continuous-batching scheduler: which requests run this step, and how many tokens each (policy only).

Policy (vLLM v1's framing, no separate prefill/decode phases):
1. running requests, decodes first (then running chunked prefills), oldest admitted first; each
   gets ``min(tokens behind, budget left)`` tokens. When one cannot get a block, the most recently
   admitted running request is preempted until it can - possibly itself (in a step nested in another, never
   one of the enclosing step's: ``core/preemption.py``). Preemption is by
   recompute (blocks freed, back to the front of waiting) or, in swap mode while CPU swap space
   has room, by swapping its blocks out (it keeps its progress and waits in the swapped queue);
2. then swapped requests, then waiting ones, in order, while ``max_num_seqs`` and the token budget
   allow and their blocks fit above the watermark (nothing joins in a step that preempted for room).
Before both, a request that grew past its restart point (``Request.restart_past``: a longrope model whose generate
recomputes the sequence there) goes back to the front of waiting, to be computed again from its first token.
A request is sampled only in a step that brings it fully up to date. Blocks are the KV manager's: the
scheduler asks it and never touches block ids or reference counts.

The k beams of a beam search group are admitted and preempted together, by recompute (a group is wholly
running or wholly waiting); a beam whose row of the round is computed waits for its group's selection.
``update_from_output`` is the other half of a step: it appends the runner's sampled tokens, forks parallel
samples, moves beams on, checks stop conditions, frees finished requests and returns their outputs.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

from ..outputs import RequestOutput, progress_output, step_outputs
from ..sampling.stopping import check_stops
from .config import EngineConfig
from .kv_manager import KVManager
from .position_table import finish_past_table
from .preemption import Preemption
from .request import Request, RequestStatus
from .runner_output import ModelRunnerOutput
from .scheduler_output import CachedRequestData, NewRequestData, ScheduledRequest, SchedulerOutput
from .sequence_groups import SequenceGroups

COUNTER_NAMES = ("num_preemptions", "num_swapped_out", "prefix_cache_queries", "prefix_cache_hits")


class Scheduler(Preemption, SequenceGroups):
    """Waiting, running and swapped queues over one KV manager."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        max_model_len: int | None = None,
        position_table: tuple[int, str] | None = None,
    ):
        self.config = config
        self.kv = kv
        # (rows, which) of the model's learned position table: a request that would forward a token past it fails
        # alone, with an IndexError (core/position_table.py)
        self.position_table = position_table
        # what users' stopping criteria raised that is not an Exception (KeyboardInterrupt...): the engine raises it
        # after the step's outputs are delivered (the update itself completes)
        self.interrupts: list[BaseException] = []
        self.failed_outputs: list[RequestOutput] = []  # of an update that failed half way (the engine hands them out)
        if position_table is not None:
            max_model_len = min(max_model_len or position_table[0], position_table[0])
        # the model's positions (a learned position table has no more rows): a request is not planned ahead past it
        self.max_model_len = max_model_len
        self.counters = kv.counters
        for key in COUNTER_NAMES:
            self.counters.setdefault(key, 0)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.watermark_blocks = int(config.watermark * kv.num_blocks)
        self._runner_has: set[str] = set()  # requests whose state the runner holds
        self._dropped: list[str] = []  # requests the runner should forget at the next step
        self._restarting = False  # some request has a restart point (Request.restart_past): checked every step

    # --- queues -----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (the first sequence of its prompt)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if self.depth:
            self._queue_nested(request)
        else:
            self.waiting.append(request)
        self._restarting = self._restarting or request.restart_past is not None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, reason: str | BaseException, error: str | BaseException | None = None) -> None:
        """Mark ``request`` finished, free its blocks, drop it from the queues (an exception: its callback's)."""
        if isinstance(reason, BaseException):
            reason, error = "error", reason
        if isinstance(error, BaseException):
            request.exception, error = error, f"{type(error).__name__}: {error}"
        with contextlib.suppress(ValueError):  # (a fork that failed half way is in no queue)
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is RequestStatus.WAITING:
                self.waiting.remove(request)
            elif request.status is RequestStatus.SWAPPED:
                self.swapped.remove(request)
        if request.status is not RequestStatus.FINISHED:
            self.kv.free(request)
            self._forget(request)
        request.finish_reason = reason
        request.error = error
        request.finish_time = time.perf_counter()
        request.num_output_placeholders = 0  # a token still in flight is dropped
        request.num_forks_pending = 0  # a prompt that ends before its first sample forks nothing
        request.status = RequestStatus.FINISHED
        self.requests.pop(request.request_id, None)  # last: a failure before it leaves the request to reset()

    def abort(self, request_id: str) -> list[Request]:
        """Finish every sequence of the prompt of ``request_id`` with reason "abort"; returns them."""
        # (the prompt's first sequence leaves the table when it finishes first: then any sequence of its prompt)
        request = self.requests.get(request_id) or next(
            (r for r in self.requests.values() if r.prompt_id == request_id), None
        )
        if request is None:
            return []
        members = [m for m in request.members if not m.is_finished]
        if request.beam_search is not None:
            request.beam_search.aborted = True
        for member in members:
            self.finish(member, "abort")
        return members

    def reset(self) -> None:
        """After a failed step: every running and swapped request goes back to waiting, to be recomputed.

        The failed step may have written part of its KV (and a swap-out may not have run): all of it is
        released. Tokens sampled by steps whose results were never read are sampled again.
        """
        requeued = self.running + list(self.swapped)
        # and any unfinished request the failure caught between queues (a preemption interrupted mid-way); a
        # finished one it caught before leaving the table leaves it now
        queued = {id(request) for request in (*requeued, *self.waiting)}
        requeued += [r for r in self.requests.values() if not r.is_finished and id(r) not in queued]
        for request_id in [rid for rid, r in self.requests.items() if r.is_finished]:
            del self.requests[request_id]
        self.running = []
        self.swapped.clear()
        for request in requeued + list(self.waiting):
            self.kv.free(request, keep_hashes=True)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.status = RequestStatus.WAITING
        self.waiting = deque(requeued + list(self.waiting))
        self.kv.take_copies()
        self._runner_has.clear()
        self._dropped = []

    def _forget(self, request: Request) -> None:
        """The runner's state of ``request`` is stale: it is dropped at the next step (and rebuilt if needed)."""
        if request.request_id in self._runner_has:
            self._runner_has.discard(request.request_id)
            self._dropped.append(request.request_id)

    # --- admission --------------------------------------------------------------------------------

    def _admit(self, request: Request, budget: int, keep_free: int) -> int:
        """Blocks for a waiting request's next chunk, reusing cached prefix blocks; the tokens to compute
        this step (0: it does not fit now)."""
        hits = self.kv.lookup_prefix(request)
        num_cached = len(hits) * self.kv.block_size
        num_new = min(request.num_tokens - num_cached, budget)
        if not self.kv.allocate(request, num_cached + num_new, keep_free, prefix_hits=hits):
            return 0
        request.num_computed_tokens = num_cached
        return num_new

    def _run(self, request: Request, num_tokens: int, scheduled: dict[str, ScheduledRequest]) -> int:
        """``request`` joins the running ones, with ``num_tokens`` to compute this step (if any); returns them."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if num_tokens:
            scheduled[request.request_id] = _scheduled(request, num_tokens, request.num_tokens)
        return num_tokens

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch, take the blocks it needs and count its tokens as computed."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        max_num_seqs = self.config.max_num_seqs
        scheduled: dict[str, ScheduledRequest] = {}
        if self._restarting:
            self._restart_long(out)
        restarted = len(out.preempted_ids)  # restarts leave admission open (they free blocks, never for room)

        # A request whose placeholder token (sampled by the step still in flight) ends it by length is not
        # planned again: it finishes when that token is read back. Nor is one whose placeholder would sit past the
        # model's positions: stock stops there only at an eos, which the placeholder may be (it waits to be read).
        decodes, prefills = [], []
        last_position = self.max_model_len or (1 << 62)
        held = self.held  # (in a nested step: requests waiting for an enclosing step's token stay where they are)
        for r in self.running if not held else [r for r in self.running if r.request_id not in held]:
            num_tokens = r.num_tokens
            behind = num_tokens - r.num_computed_tokens
            if behind == 1:
                ahead = r.num_output_placeholders
                if not (ahead and (num_tokens >= r.params.max_length or num_tokens > last_position)):
                    decodes.append((r, num_tokens))
            elif behind > 1:
                prefills.append((r, num_tokens))
        allocate, running = self.kv.allocate, RequestStatus.RUNNING
        has_room = self.kv.room_check()
        for request, num_tokens in decodes + prefills:
            if budget == 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this step
            start = request.num_computed_tokens
            num_new = min(num_tokens - start, budget)
            while not (has_room(request, start, start + num_new) or allocate(request, start + num_new)):
                if self._held_up(request, out):  # a nested step's request without room: it fails (core/preemption.py)
                    budget += self._ungrant([m for m in request.members if m.is_finished], scheduled)  # its beams'
                    break
                budget += self._ungrant(self._preempt(self._victim(), out), scheduled)  # what the victims were given
                if request.status is not running:
                    break
                num_new = min(num_tokens - start, budget)
            if request.status is not running:
                continue
            scheduled[request.request_id] = _scheduled(request, num_new, num_tokens)
            budget -= num_new

        preempted = len(out.preempted_ids) > restarted
        if not preempted:
            while self.swapped and budget > 0 and len(self.running) < max_num_seqs:
                request = self.swapped[0]
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                keep_free = self.watermark_blocks if self.running else 0
                copy = self.kv.swap_in(request, request.num_computed_tokens + num_new, keep_free)
                if copy is None:
                    break
                self.swapped.popleft()
                out.swap_in.append(copy)
                budget -= self._run(request, num_new, scheduled)
        if not preempted and not self._swapped_first():
            while self.waiting and budget > 0 and len(self.running) < max_num_seqs:
                request = self.waiting[0]
                if request.num_output_placeholders:
                    break  # restarted while its token is in flight: the runner would rebuild it without that token
                if request.beam_search is not None and len(request.group.members) > 1:
                    budget_left = self._admit_beams(request.group.members, budget, scheduled)
                    if budget_left is None:
                        break
                    budget = budget_left
                    continue
                if len(self.running) + request.num_forks_pending >= max_num_seqs:
                    break  # the sequences it forks into at its first sample would not fit
                keep_free = self.watermark_blocks if self.running else 0
                num_new = self._admit(request, budget, keep_free)
                if num_new == 0:
                    break
                self.waiting.popleft()
                budget -= self._run(request, num_new, scheduled)

        out.scheduled = list(scheduled.values())
        self._commit(out)
        return out

    def _commit(self, out: SchedulerOutput) -> None:
        """Count the step's tokens as computed, decide whether it may overlap the next, and describe it to
        the runner (new requests whole, known ones by block-table diffs)."""
        sampled = []
        for item in out.scheduled:
            request = self.requests[item.request_id]
            request.num_computed_tokens += item.num_tokens
            if item.samples:
                sampled.append(request)
            if item.request_id not in self._runner_has:
                self._runner_has.add(item.request_id)
                self.kv.take_table_update(request)
                out.new_requests.append(NewRequestData.of(request, self.kv.block_ids(request)))
            else:
                update = self.kv.take_table_update(request)
                if update is not None:
                    out.cached_requests.append(CachedRequestData(item.request_id, *update))
        # Sampling that reads the token history, forks or moves beams needs this step's tokens before the
        # next step is planned; otherwise they count as placeholders until they are read. (A nested step's are read
        # before it returns: the enclosing step's own result is the one in flight after it.)
        out.nested = self.depth > 0
        out.overlapped = (
            self.config.async_scheduling
            and not out.nested
            and not any(
                r.params.stages_read_history or r.num_forks_pending or r.beam_search is not None for r in sampled
            )
        )
        if out.overlapped:
            for request in sampled:
                request.num_output_placeholders += 1
        out.dropped_ids, self._dropped = self._dropped, []
        out.block_copies = self.kv.take_copies()

    # --- results ----------------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Append the step's sampled tokens, fork, move beams on, finish what stops; one output per request that
        gained tokens. Requests finished since the step was scheduled are skipped (by object: ids may be reused)."""
        self.raise_if_nested_failed()  # (in this step's execute, or an update before: core/preemption.py)
        requests = {r.request_id: r.request for r in out.scheduled if self.requests.get(r.request_id) is r.request}
        if self.kv.prefix_cache is not None:  # the step's KV is computed: its full blocks can serve later prompts
            bs = self.kv.block_size
            for item in out.scheduled:
                if (item.start + item.num_tokens) // bs > item.start // bs:
                    request = requests.get(item.request_id)
                    if request is not None and request.status is RequestStatus.RUNNING:
                        self.kv.register_computed(request)
        advanced: list[Request] = []
        outputs: list[RequestOutput] = []
        cut = None  # the group forking or moving its beams now (neither has an undo)
        try:
            logprobs, top_logprobs, errors = result.logprobs, result.top_logprobs, result.errors
            for row, (request_id, token_id) in enumerate(zip(result.request_ids, result.token_ids)):
                request = requests.get(request_id)
                if request is None:
                    continue
                if out.overlapped:
                    request.num_output_placeholders -= 1
                if errors and request_id in errors:
                    self.finish(request, "error", errors[request_id])
                    outputs.append(progress_output(request, 0))
                    continue
                request.append_token(
                    token_id, logprobs[row] if logprobs else None, top_logprobs[row] if top_logprobs else None
                )
                advanced.append(request)
                if request.num_forks_pending:
                    cut = request.group
                    for fork in result.forks.get(request_id, ()):
                        advanced.append(self._fork(request, fork.sequence_index, fork.params, fork.sampled))
                    request.num_forks_pending, cut = 0, None
            for beam_round in result.beam_rounds:
                cut = getattr(self.requests.get(beam_round.root_id), "group", None)
                outputs += self._advance_beams(beam_round)
                cut = None
            for request, reason in zip(advanced, check_stops(advanced, self.interrupts)):
                if reason is not None:
                    self.finish(request, reason)
            if self.position_table is not None:  # its next token past the table: stock raises IndexError there
                outputs += finish_past_table(self, advanced, result.beam_rounds)
        except BaseException as error:  # half way (an internal error): no token may go on unchecked
            self.failed_outputs = outputs + self._fail_half_done(advanced, cut, requests.values(), outputs, error)
            raise
        return outputs + step_outputs(advanced)


def _scheduled(request: Request, num_new: int, num_tokens: int) -> ScheduledRequest:
    """``num_new`` of ``request``'s tokens (``num_tokens`` in all, placeholders included) in this step."""
    start = request.num_computed_tokens
    return ScheduledRequest(request.request_id, start, num_new, start + num_new == num_tokens, request)
