"""The scheduler's part for prompts of several sequences: parallel samples fork off their first request at its
first sample, and the k beams of a beam search are admitted together and moved on round by round."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..outputs import RequestOutput, final_output, progress_output, sequence_output, step_outputs
from .request import Request, RequestStatus

if TYPE_CHECKING:
    from ..sampling.params import RequestParams
    from .runner_output import BeamRound, SampledToken
    from .scheduler_output import ScheduledRequest


class SequenceGroups:
    """Mixin of ``Scheduler`` (its queues, KV manager and helpers)."""

    def _admit_beams(self, members: list[Request], budget: int, scheduled: dict[str, ScheduledRequest]) -> int | None:
        """Admit all the beams of a re-queued group, or none; returns the token budget left (None: none).

        All their blocks must fit above the watermark; beams past the token budget join without tokens
        this step and are prefilled in the next ones.
        """
        if len(self.running) + len(members) > self.config.max_num_seqs:
            return None
        keep_free = self.watermark_blocks if self.running else 0
        if self.kv.num_free_blocks - sum(self.kv.blocks_for(m.num_tokens) for m in members) < keep_free:
            return None
        for member in members:
            num_new = self._admit(member, budget, 0) if budget > 0 else 0
            self.waiting.remove(member)
            budget -= self._run(member, num_new, scheduled)
        return budget

    def _fork(self, parent: Request, index: int, params: RequestParams, sampled: SampledToken) -> Request:
        """Parallel sampling: sequence ``index`` of the parent's prompt forks off it with its own first token."""
        child = parent.group.add_member(f"{parent.request_id}.{index}", params, index)
        self._start_fork(child, parent)
        child.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
        return child

    def _start_fork(self, child: Request, parent: Request) -> None:
        """``child`` shares ``parent``'s blocks and progress, and runs."""
        self.kv.fork(child, parent)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.requests[child.request_id] = child

    def _advance_beams(self, beam_round: BeamRound) -> list[RequestOutput]:
        """A group's selection: beam j continues beam ``parents[j]`` (its tokens and blocks) plus ``tokens[j]``.
        When the search has ended, its returned sequences are the outputs."""
        root = self.requests.get(beam_round.root_id)
        if root is None:
            return []
        group = root.group
        search = group.beam_search
        search.commit()  # the members take this round's tokens below (or the search ends)
        if beam_round.error is not None:  # its processors or criteria raised: the search ends with that error
            for member in [m for m in group.members if not m.is_finished]:
                self.finish(member, beam_round.error)
            return [progress_output(root, 0)]
        if root.first_token_time is None:
            root.first_token_time = time.perf_counter()
        root.num_forks_pending = 0
        if not beam_round.unfinished:
            for member in list(group.members):
                if not member.is_finished:
                    self.finish(member, "stop")
            return [
                sequence_output(root, seq.token_ids, finish_reason=seq.finish_reason, sequence_index=i)
                for i, seq in enumerate(search.returned_sequences())
            ]
        first_round = len(group.members) == 1
        if first_round:  # every row was the prompt's: the other beams fork off it
            for slot in range(1, group.num_sequences):
                self._start_fork(group.add_member(f"{root.request_id}.beam{slot}", root.params, slot), root)
        members = group.members  # (a new list each time)
        sources = [root] * group.num_sequences if first_round else [members[p] for p in beam_round.parents]
        taken = [
            (source.all_token_ids + [token], source.num_computed_tokens)
            for source, token in zip(sources, beam_round.tokens)
        ]
        self.kv.share(members, sources)
        for member, (token_ids, num_computed) in zip(members, taken):
            member.all_token_ids = token_ids
            member.num_computed_tokens = num_computed
            self._forget(member)  # its tokens and table are another beam's now: the runner rebuilds its state
        return []

    def _fail_half_done(self, advanced: list[Request], cut, scheduled, reported: list, error) -> list[RequestOutput]:
        """An update that failed half way. Every request of ``advanced`` that is not finished gives its new token back
        (sampled again when it is recomputed; it may not have been stop- or table-checked); the finished ones keep it
        and are reported. Every sequence of the prompt whose fork or beam round the failure cut off (``cut``: its
        group, or None; neither has an undo) fails with ``error``, and so does a beam search of ``scheduled`` that
        ended or began to end in the update without reporting it (``reported``: the outputs so far). Returns the
        outputs still owed (the kept tokens, the failed sequences, samples not forked yet, a beam search's one)."""
        reported_ids = {output.prompt_id for output in reported}
        groups = {} if cut is None else {id(cut): cut}
        for request in scheduled:  # a beam search that ended, or began to end, here without reporting it
            group = request.group
            if group is None or group.beam_search is None or group.members[0].prompt_id in reported_ids:
                continue
            if any(member.is_finished for member in group.members):
                groups[id(group)] = group
        members = {id(m) for g in groups.values() for m in g.members}
        for request in advanced:
            if id(request) not in members and not request.is_finished:
                request.pop_token()
        outputs = step_outputs([r for r in advanced if r.is_finished and id(r) not in members])
        for group in groups.values():
            root = group.members[0]
            if group.beam_search is None:  # the samples not forked yet: made, to fail and report like the others
                for index in range(len(group.members), group.num_sequences):
                    group.add_member(f"{root.request_id}.{index}", root.params, index)
            for member in [m for m in group.members if not m.is_finished]:
                self.finish(member, error)
                if group.beam_search is None:  # as step_outputs: a streamed sequence's new token (if any), else all
                    streamed = progress_output(member, int(member in advanced)) if member.stream_outputs else None
                    outputs.append(streamed or final_output(member))
            if group.beam_search is not None:  # one output, the search's error (its beams may have ended "stop")
                group.beam_search.aborted = True
                root.finish_reason, root.exception, root.error = "error", error, f"{type(error).__name__}: {error}"
                outputs.append(progress_output(root, 0))
        return outputs
