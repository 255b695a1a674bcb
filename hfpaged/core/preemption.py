"""The scheduler's preemption: a request that cannot get a block frees another's (recompute or swap), longrope
restarts, and the one case where preempting cannot help - a step nested in another step of the same engine.

A ``generate_many`` on the same model from inside one of its steps (a logits processor or stopping criterion
generating with it) runs steps of its own while the enclosing step waits for it. The requests that wait for their
token from the enclosing step (``held``: sampled by it, or by the step in flight) cannot move before it ends, which
it cannot before the nested call returns, so they keep their blocks and sequence slots: a nested request that needs
room only they hold would be preempted and re-admitted without end, or never admitted. It fails instead, naming the
room it lacks. Held requests are neither scheduled nor preempted in a nested step. The enclosing calls' other
requests (prompts still prefilling, waiting or swapped) move on there like any other, but queue behind the nested
call's prompts and are preempted, never failed, when they lack room. A nested step runs eagerly and is never
overlapped (the runner: a CUDA graph replay would overwrite outputs the enclosing step still reads), and a nested
step that fails takes the enclosing step down with it (``nested_failure``): its reset requeued every request.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..outputs import RequestOutput, progress_output
from .request import LONG_ROPE_SALT, Request, RequestStatus

if TYPE_CHECKING:
    from .scheduler_output import ScheduledRequest, SchedulerOutput


class Preemption:
    """Mixin of ``Scheduler`` (its queues, KV manager and helpers)."""

    # (ids of the requests that wait for a token from a step under way, how many steps are under way): outside
    # steps empty and 0; in a step nested in another (a generate_many from a processor) both > 0
    nesting: tuple[frozenset[str], int] = (frozenset(), 0)
    nested_failure: BaseException | None = None  # a nested step's failure, whose reset undid the enclosing step

    def _preempt(self, request: Request, out: SchedulerOutput, restart: bool = False) -> list[Request]:
        """Preempt ``request``, or every beam of its group with it; returns the requests preempted. ``restart``:
        by recompute, not counted (``_restart_long``)."""
        if request.beam_search is None:
            self._preempt_one(request, out, allow_swap=not restart, count=not restart)
            return [request]
        members = [m for m in request.group.members if m.status is RequestStatus.RUNNING]
        for member in reversed(members):  # back to the front of waiting together, in beam order
            self._preempt_one(member, out, allow_swap=False, count=not restart)
        return members

    def _preempt_one(self, request: Request, out: SchedulerOutput, allow_swap: bool, count: bool = True) -> None:
        self.running.remove(request)
        out.preempted_ids.append(request.request_id)
        self._forget(request)
        if count:
            request.num_preemptions += 1
            self.counters["num_preemptions"] += 1
        if allow_swap and self.config.preemption_mode == "swap":
            copy = self.kv.swap_out(request)
            if copy is not None:
                out.swap_out.append(copy)
                request.status = RequestStatus.SWAPPED
                self.counters["num_swapped_out"] += 1
                if self.depth and request.members[0].added_depth >= self.depth:  # a nested call's: ahead of the
                    self.swapped.insert(self._nested_prefix(self.swapped), request)  # enclosing calls' (no room)
                else:
                    self.swapped.append(request)
                return
        self.kv.free(request, keep_hashes=True)  # recompute (also the fallback when swap space is full)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        if self.depth and request.members[0].added_depth < self.depth:
            self.waiting.insert(self._nested_prefix(self.waiting), request)  # behind the nested call's (_queue_nested)
        else:
            self.waiting.appendleft(request)

    def _restart_long(self, out: SchedulerOutput) -> None:
        """Requests that grew past their ``restart_past`` tokens with short keys are computed again from their
        first token, salted (what the model's generate does there): running ones (with their beam group) and
        swapped ones go back to the front of waiting; a waiting one (a token of a step in flight landed after it
        was preempted) is salted where it is. Their hashes, chained without the salt, are dropped."""
        for request in [
            r
            for r in self.requests.values()
            if r.restart_past is not None and r.cache_salt is None and r.num_tokens > r.restart_past
        ]:
            if request.cache_salt is not None:
                continue  # restarted with its beam group
            members = [request]
            if request.status is RequestStatus.RUNNING:
                members = self._preempt(request, out, restart=True)
            elif request.status is RequestStatus.SWAPPED:
                self.swapped.remove(request)
                request.num_computed_tokens = 0
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
            for member in members:
                self.kv.free(member)
                member.cache_salt = LONG_ROPE_SALT

    # --- a step nested in another ---------------------------------------------------------------------

    @property
    def held(self) -> frozenset[str]:
        return self.nesting[0]

    @property
    def depth(self) -> int:
        return self.nesting[1]

    def enter_step(self, out: SchedulerOutput, in_flight: SchedulerOutput | None) -> None:
        """Step ``out`` runs (and ``in_flight``'s tokens may be read) until ``nesting`` is set back: a step nested in
        it leaves alone the requests that wait for a token from either (``EngineCore.step``)."""
        held, depth = self.nesting
        steps = (out, in_flight) if in_flight is not None else (out,)
        self.nesting = (
            held | {item.request_id for step in steps for item in step.scheduled if item.samples},
            depth + 1,
        )

    def raise_if_nested_failed(self) -> None:
        """A step nested in the one under way failed: its reset put every request back to be recomputed (and undid
        beam rounds) under this step, which must fail too - also when the nested call's caller caught the error."""
        error, self.nested_failure = self.nested_failure, None
        if error is not None:
            raise RuntimeError(
                "a generate_many nested in this step (from a logits processor or stopping criterion) failed with "
                f"{type(error).__name__}: {error}; the engine's requests were reset under this step, which fails too"
            ) from error

    def _held_up(self, request: Request, out: SchedulerOutput) -> bool:
        """Whether ``request``, a nested call's request that needs a block, can get it from no one: every other running
        request waits for an enclosing step's token. Then it fails with the reason (its outputs in ``out.failed``)."""
        if not self.held or request.members[0].added_depth < self.depth:
            return False  # (not a nested call's: it waits, preempted, for the enclosing step like any other)
        mine = {id(member) for member in request.members} if request.beam_search is not None else {id(request)}
        if any(id(r) not in mine and r.request_id not in self.held for r in self.running):
            return False  # another request outside the enclosing step can be preempted (or finish) first
        out.failed += self._fail_beside_held(request)
        return True

    def _victim(self) -> Request:
        """The request to preempt for room: the most recently admitted running one that waits for no enclosing
        step's token (``_held_up`` has made sure there is one)."""
        return next(r for r in reversed(self.running) if r.request_id not in self.held)

    def _ungrant(self, requests: list[Request], scheduled: dict[str, ScheduledRequest]) -> int:
        """Take back what ``requests`` were granted earlier in this step (preempted or failed); the tokens freed."""
        undone = [scheduled.pop(request.request_id, None) for request in requests]
        return sum(item.num_tokens for item in undone if item is not None)

    def _swapped_first(self) -> bool:
        """Whether swapped requests keep the waiting ones out this step (they come back first). In a nested step only
        the nested call's own do: the enclosing calls' may not fit before the enclosing step ends."""
        if not self.depth:
            return bool(self.swapped)
        return any(request.members[0].added_depth >= self.depth for request in self.swapped)

    def _queue_nested(self, request: Request) -> None:
        """A prompt added by a ``generate_many`` nested in a step waits ahead of the enclosing calls' waiting
        prompts (behind its own call's and deeper ones): those cannot move on before it returns."""
        request.added_depth = self.depth
        self.waiting.insert(self._nested_prefix(self.waiting), request)

    def _nested_prefix(self, queue: deque[Request]) -> int:
        """How many requests of ``queue``, from the front, belong to the nested call of this depth (or deeper)."""
        depth = self.depth
        return next((i for i, r in enumerate(queue) if r.members[0].added_depth < depth), len(queue))

    def no_progress(self, out: SchedulerOutput, depth: int) -> list[RequestOutput]:
        """Step ``out`` scheduled nothing, with no step in flight and requests unfinished, inside ``depth`` steps
        under way. In a nested step that preempted, the next step may admit what it freed room for: nothing to do.
        Otherwise there the first queued prompt of the nested call cannot join beside the requests waiting for the
        enclosing step, now or later: it fails (its outputs). Outside nested steps nothing can ever run: an error."""
        if depth and out.preempted_ids:
            return []
        if depth:
            for request in (*self.swapped, *self.waiting):
                if request.members[0].added_depth >= depth:
                    return self._fail_beside_held(request)
        raise RuntimeError(
            "scheduler made no progress: nothing could be scheduled and no step is in flight "
            f"({len(self.waiting)} waiting, {len(self.running)} running, {len(self.swapped)} swapped, "
            f"{self.kv.num_free_blocks} of {self.kv.num_blocks} blocks free)"
        )

    def _fail_beside_held(self, request: Request) -> list[RequestOutput]:
        held = [r for r in self.running if r.request_id in self.held]
        blocks = len({block for r in held for block in self.kv.block_ids(r)})
        members = [m for m in request.members if not m.is_finished] if request.beam_search is not None else [request]
        sequences = len(members) + request.members[0].num_forks_pending  # (beams or samples it forks into)
        prompt = f"prompt {request.index}" if request.index is not None else f"request {request.request_id!r}"
        error = RuntimeError(
            f"{prompt} cannot run inside a step of the same model (a generate_many from a logits processor or "
            f"stopping criterion): the sequences waiting for that step's tokens ({len(held)}) keep {blocks} of the "
            f"{self.kv.num_blocks} KV blocks and {len(held)} of max_num_seqs={self.config.max_num_seqs} until it "
            f"ends, and this prompt needs {sequences} more sequence(s) and at least "
            f"{self.kv.blocks_for(request.num_tokens + 1)} blocks beside them (and the watermark's "
            f"{self.watermark_blocks}). Patch with more num_blocks or max_num_seqs, or generate outside the step"
        )
        for member in members:
            self.finish(member, "error", error)
        return [progress_output(member, 0) for member in members]
