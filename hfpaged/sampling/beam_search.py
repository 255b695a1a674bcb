"""Beam search (``num_beams=k``) over the shared pool, round for round transformers' ``_beam_search``.

A group's k beams are k requests in the scheduler. Every round each beam computes one token and the runner
hands its last logits row to the group's ``BeamSearch``; once the rows of all live beams are in, it runs
transformers' own beam steps on them with batch size 1 (``_get_top_k_continuations``,
``_get_running_beams_for_next_iteration``, ``_update_finished_beams``, ``_check_early_stop_heuristic``,
``_beam_search_has_unfinished_sequences``, through ``hf_compat``), with generate's processors and stopping
criteria - so tokens, scores, ties and the order of the returned sequences are transformers'. The selection
(beam j continues beam p with token t) goes back to the scheduler, which gives beam j p's tokens plus t and
p's block table (``KVManager.share``: one more reference on each block, the blocks no beam continues are
freed), so beams share their common prefix and the partly filled last block is copied on write when a beam
first writes into it. The prompt is prefilled once: the first round's k identical rows are that one row
repeated, and the other k - 1 beams fork off the first request then.

The scheduler admits and preempts a group as a whole (by recompute; preemption drops the rows of the
round in progress), so when a round's rows are complete every beam is running with its KV in place.
Beam sampling (``do_sample=True``) calls the same steps, which draw with ``torch.multinomial``: the
draw uses the request's seed and the round (a seeded generator state, restored afterwards).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..model import hf_compat
from .parallel_sampling import sample_seed
from .params import RequestParams


@dataclass
class BeamSequence:
    """One returned hypothesis: generated ids, generate's ``sequences_scores`` entry, and why it ended."""

    token_ids: list[int]
    score: float
    finish_reason: str


class BeamSearch:
    """transformers' beam-search state for the k beams of one prompt (batch size 1), and this round's rows."""

    def __init__(
        self,
        model: Any,
        request_id: str,
        params: RequestParams,
        prompt_token_ids: list[int],
        device: torch.device | str,
    ):
        config = params.generation_config
        self.request_id = request_id  # the group's first request (the prompt's)
        self.device = torch.device(device)
        self.num_beams = num_beams = config.num_beams
        self.num_return_sequences = config.num_return_sequences or 1
        self.do_sample = bool(config.do_sample)
        self.early_stopping = config.early_stopping
        self.length_penalty = config.length_penalty
        self.max_length = config.max_length
        self.eos_token_ids = params.eos_token_ids
        self.processors = params.beam_processors
        self.stopping_criteria = params.stop.all_criteria
        self.max_time = params.stop.max_time  # (a MaxTimeCriteria: a search it ends reports "time")
        self.seed = params.seed
        self.steps = hf_compat.BeamSearchSteps(model)
        self.prompt_len = self.cur_len = len(prompt_token_ids)
        self.num_live = 1  # beams computing rows each round: the prompt's alone until the first round ends
        self.rows: list[torch.Tensor | None] = [None]  # this round's logits row of each slot
        self.num_rows = 0
        self.num_rounds = 0
        self.is_done = False
        self.aborted = False
        # the state before the last round's selection, until the scheduler takes that round (``commit``): a step
        # that fails in between (``rollback``) leaves the search where its beams' tokens are
        self.undo: dict[str, Any] | None = None

        # transformers' _beam_search state, initialized as it does (batch_size = 1)
        device = self.device
        eos = hf_compat.eos_token_tensor(config)
        pad = hf_compat.pad_token_tensor(config)
        num_eos = eos.shape[0] if eos is not None else 0
        self.beams_to_keep = max(2, 1 + num_eos) * num_beams
        self.top_num_beam_mask = torch.cat(
            (torch.ones(num_beams, dtype=torch.bool), torch.zeros(self.beams_to_keep - num_beams, dtype=torch.bool))
        ).to(device)
        fill = pad or eos[0] if eos is not None else -1
        self.running_sequences = torch.full(
            (1, num_beams, self.max_length), fill_value=fill, dtype=torch.int64, device=device
        )
        self.running_sequences[:, :, : self.cur_len] = torch.tensor(prompt_token_ids, device=device)
        self.sequences = self.running_sequences.clone()
        self.running_beam_scores = torch.zeros((1, num_beams), dtype=torch.float, device=device)
        self.running_beam_scores[:, 1:] = -1e9
        self.beam_scores = torch.full((1, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
        self.is_sent_finished = torch.zeros((1, num_beams), dtype=torch.bool, device=device)
        self.is_early_stop_heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool, device=device)
        self.running_beam_indices = torch.full(
            (1, num_beams, self.max_length - self.cur_len), fill_value=-1, dtype=torch.int32, device=device
        )
        self.beam_indices = self.running_beam_indices.clone()

    # --- rows -----------------------------------------------------------------------------------

    def take_row(self, slot: int, row: torch.Tensor) -> bool:
        """Keep beam ``slot``'s logits row of this round; True when it completes the round."""
        if self.rows[slot] is None:
            self.num_rows += 1
        self.rows[slot] = row
        return self.num_rows == self.num_live

    def forget_rows(self) -> None:
        """Drop this round's rows (the group was preempted: its beams compute them again)."""
        self.rows = [None] * self.num_live
        self.num_rows = 0

    # --- one round ------------------------------------------------------------------------------

    def advance(self) -> tuple[list[int], list[int], bool]:
        """Select this round's continuations: (parent slot, token) of each new beam, and whether the search
        goes on. The rows are consumed; after the first round all k beams compute rows. Until ``commit`` the
        round can be undone (``rollback``)."""
        undo = {name: _copied(getattr(self, name)) for name in _ROUND_STATE}
        parents, tokens, unfinished = self._select()
        self.num_rounds += 1
        self.is_done = not unfinished
        self.num_live = self.num_beams
        self.forget_rows()
        self.undo = undo
        return parents, tokens, unfinished

    def commit(self) -> None:
        """The scheduler took the last round (its beams carry its tokens now)."""
        self.undo = None

    def rollback(self) -> None:
        """A step failed: back to the state the beams' tokens reflect (a round selected but never taken by the
        scheduler is undone), and this round's rows are computed again."""
        if self.undo is not None:
            for name, value in self.undo.items():
                setattr(self, name, value)
            self.undo = None
        self.forget_rows()

    def _select(self) -> tuple[list[int], list[int], bool]:
        """transformers' beam-search iteration on this round's rows: (parent slot, token) of each new beam."""
        steps, num_beams, cur_len, prompt_len = self.steps, self.num_beams, self.cur_len, self.prompt_len
        rows = self.rows if len(self.rows) == num_beams else self.rows * num_beams
        logits = torch.stack(rows).to(device=self.device, dtype=torch.float32)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        flat_running_sequences = steps.flatten(self.running_sequences[:, :, :cur_len])
        log_probs = self.processors(flat_running_sequences, log_probs)
        vocab_size = log_probs.shape[-1]
        log_probs = steps.unflatten(log_probs, num_beams)
        log_probs = log_probs + self.running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (1, num_beams * vocab_size))

        def top_k_continuations() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return steps.top_k_continuations(
                accumulated_log_probs=log_probs,
                running_sequences=self.running_sequences,
                running_beam_indices=self.running_beam_indices,
                cur_len=cur_len,
                decoder_prompt_len=prompt_len,
                do_sample=self.do_sample,
                beams_to_keep=self.beams_to_keep,
                num_beams=num_beams,
                vocab_size=vocab_size,
            )

        if self.do_sample:
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = _seeded(
                self.device, sample_seed(self.seed, 1 + self.num_rounds), top_k_continuations
            )
        else:
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = top_k_continuations()

        hits = self.stopping_criteria(steps.flatten(topk_running_sequences[:, :, : cur_len + 1]), None)
        hits = steps.unflatten(hits, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            steps.running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs,
                topk_running_sequences=topk_running_sequences,
                topk_running_beam_indices=topk_running_beam_indices,
                next_token_hits_stopping_criteria=hits,
                num_beams=num_beams,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = steps.update_finished_beams(
            sequences=self.sequences,
            topk_running_sequences=topk_running_sequences,
            beam_scores=self.beam_scores,
            topk_log_probs=topk_log_probs,
            beam_indices=self.beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            is_sent_finished=self.is_sent_finished,
            next_token_hits_stopping_criteria=hits,
            top_num_beam_mask=self.top_num_beam_mask,
            num_beams=num_beams,
            cur_len=cur_len,
            decoder_prompt_len=prompt_len,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
        self.cur_len = cur_len = cur_len + 1
        self.is_early_stop_heuristic_unsatisfied = steps.check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=self.is_early_stop_heuristic_unsatisfied,
            running_beam_scores=self.running_beam_scores,
            beam_scores=self.beam_scores,
            is_sent_finished=self.is_sent_finished,
            cur_len=cur_len,
            max_length=self.max_length,
            decoder_prompt_len=prompt_len,
            early_stopping=self.early_stopping,
            length_penalty=self.length_penalty,
        )
        unfinished = steps.has_unfinished_sequences(
            self.is_early_stop_heuristic_unsatisfied, self.is_sent_finished, hits, self.early_stopping
        )
        # one device->host copy: each new beam's parent slot and token, and whether the search goes on
        step = cur_len - 1
        picked = torch.cat(
            [
                self.running_beam_indices[0, :, step - prompt_len].to(torch.int64),
                self.running_sequences[0, :, step],
                unfinished.reshape(1).to(torch.int64),
            ]
        ).tolist()
        return picked[:num_beams], picked[num_beams : 2 * num_beams], bool(picked[-1])

    # --- results --------------------------------------------------------------------------------

    def returned_sequences(self) -> list[BeamSequence]:
        """The best ``num_return_sequences`` finished hypotheses, in generate's order, each at its own length."""
        count = self.num_return_sequences
        if not self.is_done:  # aborted: the running beams so far
            sequences, scores, indices = self.running_sequences, self.running_beam_scores, self.running_beam_indices
        else:
            sequences, scores, indices = self.sequences, self.beam_scores, self.beam_indices
        lengths = (indices[0, :count] != -1).sum(dim=-1).tolist()
        rows = sequences[0, :count].tolist()
        values = scores[0, :count].tolist()
        out = []
        for ids, length, score in zip(rows, lengths, values):
            generated = ids[self.prompt_len : self.prompt_len + length]
            out.append(BeamSequence(generated, score, self._finish_reason(generated)))
        return out

    def _finish_reason(self, generated: list[int]) -> str:
        if self.aborted:
            return "abort"
        if generated and generated[-1] in self.eos_token_ids:
            return "stop"
        if self.prompt_len + len(generated) >= self.max_length:
            return "length"
        max_time = self.max_time
        if max_time is not None and time.time() - max_time.initial_timestamp > max_time.max_time:
            return "time"  # as a greedy or sampled request cut by max_time reports
        return "stop"


# what a round's selection changes (``BeamSearch.advance``)
_ROUND_STATE = (
    "running_sequences", "running_beam_scores", "running_beam_indices", "sequences", "beam_scores", "beam_indices",
    "is_sent_finished", "is_early_stop_heuristic_unsatisfied", "cur_len", "num_rounds", "is_done", "num_live",
)  # fmt: skip


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _seeded(device: torch.device, seed: int, fn: Any) -> Any:
    """``fn()`` with the default generator of ``device`` seeded with ``seed``, its state restored afterwards."""
    if device.type == "cuda":
        generator = torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
    else:
        generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        return fn()
    finally:
        generator.set_state(state)
