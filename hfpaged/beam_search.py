"""Beam search (``num_beams=k``) over the shared pool, round for round transformers' ``_beam_search``.

A group's k beams are k requests in the scheduler. Every round each beam computes one token and hands
the group its last logits row; once the rows of all k beams are in, the group runs transformers' own
beam helpers on them with batch size 1 (``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``, ``_beam_search_has_unfinished_sequences``), with
generate's processors and stopping criteria - so tokens, scores, ties and the order of the returned
sequences are transformers'. The new beam j continues beam p with token t: its request takes p's tokens
plus t and p's block table (``Scheduler.share_blocks``: one more reference on each block, the blocks no
beam continues are freed), so beams share their common prefix and the partly filled last block is copied
on write when a beam first writes into it. The prompt is prefilled once: the first round's k identical
rows are that one row repeated, and the other k - 1 beams fork off the first request then.

The scheduler admits and preempts a group as a whole (by recompute; preemption drops the rows of the
round in progress), so when a round's rows are complete every beam is running with its KV in place.
Beam sampling (``do_sample=True``) calls the same helpers, which draw with ``torch.multinomial``: the
draw uses the request's seed and the round (a seeded generator state, restored afterwards).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .parallel_sampling import sample_seed
from .request import Request

if TYPE_CHECKING:
    from .scheduler import Scheduler


@dataclass
class BeamSequence:
    """One returned hypothesis: generated ids, generate's ``sequences_scores`` entry, and why it ended."""

    token_ids: list[int]
    score: float
    finish_reason: str


class BeamGroup:
    """The k beams of one prompt and transformers' beam-search state for them (batch size 1)."""

    def __init__(self, model: Any, root: Request, device: torch.device | str):
        params = root.params
        config = params.generation_config
        self.model = model
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
        self.seed = params.seed
        self.prompt_len = self.cur_len = root.num_prompt_tokens
        self.members = [root]  # the request of each beam slot; only the first until the first round ends
        self.rows: list[torch.Tensor | None] = [None]  # this round's logits row of each slot
        self.num_rows = 0
        self.num_rounds = 0
        self.is_done = False
        self.aborted = False
        root.beam_group = self
        root.num_forks_pending = num_beams - 1

        # transformers' _beam_search state, initialized as it does (batch_size = 1)
        device = self.device
        eos = config._eos_token_tensor
        pad = config._pad_token_tensor
        num_eos = eos.shape[0] if eos is not None else 0
        self.beams_to_keep = max(2, 1 + num_eos) * num_beams
        self.top_num_beam_mask = torch.cat(
            (torch.ones(num_beams, dtype=torch.bool), torch.zeros(self.beams_to_keep - num_beams, dtype=torch.bool))
        ).to(device)
        fill = pad or eos[0] if eos is not None else -1
        self.running_sequences = torch.full((1, num_beams, self.max_length), fill_value=fill, dtype=torch.int64, device=device)
        self.running_sequences[:, :, : self.cur_len] = torch.tensor(root.prompt_token_ids, device=device)
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

    def take_row(self, request: Request, row: torch.Tensor) -> bool:
        """Keep ``request``'s logits row of this round; True when it completes the round."""
        slot = request.sequence_index
        if self.rows[slot] is None:
            self.num_rows += 1
        self.rows[slot] = row
        return self.num_rows == len(self.members)

    def forget_rows(self) -> None:
        """Drop this round's rows (the group was preempted: its beams compute them again)."""
        self.rows = [None] * len(self.members)
        self.num_rows = 0

    # --- one round ------------------------------------------------------------------------------

    def advance(self, scheduler: "Scheduler") -> bool:
        """Select this round's continuations and move the beams on; True when the search has ended."""
        parents, tokens, unfinished = self._select()
        self.num_rounds += 1
        root = self.members[0]
        if self.num_rounds == 1:
            root.first_token_time = root.first_token_time or time.perf_counter()
            root.num_forks_pending = 0
        if not unfinished:
            self.is_done = True
            for member in self.members:
                if not member.is_finished:
                    scheduler.finish(member, "stop")
            return True
        if len(self.members) == 1:  # first round: every row was the prompt's; the other beams fork off it
            for slot in range(1, self.num_beams):
                beam = Request(f"{root.request_id}.beam{slot}", root.prompt_token_ids, root.params, index=root.index)
                beam.beam_group = self
                beam.sequence_index = slot
                beam.arrival_time = root.arrival_time
                scheduler.fork(beam, root)
                self.members.append(beam)
            sources = [root] * self.num_beams
        else:
            sources = [self.members[p] for p in parents]
        token_lists = [source.all_token_ids + [token] for source, token in zip(sources, tokens)]
        scheduler.share_blocks(self.members, sources)
        for member, ids in zip(self.members, token_lists):
            member.all_token_ids = ids
        self.forget_rows()
        return False

    def _select(self) -> tuple[list[int], list[int], bool]:
        """transformers' beam-search iteration on this round's rows: (parent slot, token) of each new beam."""
        model, num_beams, cur_len, prompt_len = self.model, self.num_beams, self.cur_len, self.prompt_len
        rows = self.rows if len(self.rows) == num_beams else self.rows * num_beams
        logits = torch.stack(rows).to(device=self.device, dtype=torch.float32)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
        flat_running_sequences = model._flatten_beam_dim(self.running_sequences[:, :, :cur_len])
        log_probs = self.processors(flat_running_sequences, log_probs)
        vocab_size = log_probs.shape[-1]
        log_probs = model._unflatten_beam_dim(log_probs, 1, num_beams)
        log_probs = log_probs + self.running_beam_scores[:, :, None]
        log_probs = torch.reshape(log_probs, (1, num_beams * vocab_size))

        def top_k_continuations() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return model._get_top_k_continuations(
                accumulated_log_probs=log_probs,
                running_sequences=self.running_sequences,
                running_beam_indices=self.running_beam_indices,
                cur_len=cur_len,
                decoder_prompt_len=prompt_len,
                do_sample=self.do_sample,
                beams_to_keep=self.beams_to_keep,
                num_beams=num_beams,
                batch_size=1,
                vocab_size=vocab_size,  # transformers <= 5.17 takes it; later versions read it from the scores
            )

        if self.do_sample:
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = _seeded(
                self.device, sample_seed(self.seed, 1 + self.num_rounds), top_k_continuations
            )
        else:
            topk_log_probs, topk_running_sequences, topk_running_beam_indices = top_k_continuations()

        hits = self.stopping_criteria(model._flatten_beam_dim(topk_running_sequences[:, :, : cur_len + 1]), None)
        hits = model._unflatten_beam_dim(hits, 1, self.beams_to_keep)
        self.running_sequences, self.running_beam_scores, self.running_beam_indices = (
            model._get_running_beams_for_next_iteration(
                topk_log_probs=topk_log_probs,
                topk_running_sequences=topk_running_sequences,
                topk_running_beam_indices=topk_running_beam_indices,
                next_token_hits_stopping_criteria=hits,
                num_beams=num_beams,
            )
        )
        self.sequences, self.beam_scores, self.beam_indices, self.is_sent_finished = model._update_finished_beams(
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
        self.is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
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
        unfinished = model._beam_search_has_unfinished_sequences(
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
        return "stop"


def take_beam_rows(
    logits: torch.Tensor, requests: list[Request]
) -> tuple[torch.Tensor, list[Request], list[tuple[Request, torch.Tensor]]]:
    """Split the beams' rows off a step's logits: (other logits, other requests, [(beam request, row)]).

    The beams' rows are copied out (a CUDA-graph step returns a view of a buffer the next step reuses).
    """
    beam_rows = [i for i, request in enumerate(requests) if request.beam_group is not None]
    if not beam_rows:
        return logits, requests, []
    device = logits.device
    rows = logits.index_select(0, torch.tensor(beam_rows).to(device, non_blocking=True))
    taken = [(requests[i], rows[j]) for j, i in enumerate(beam_rows)]
    if len(beam_rows) == len(requests):
        return logits[:0], [], taken
    keep = [i for i, request in enumerate(requests) if request.beam_group is None]
    return logits.index_select(0, torch.tensor(keep).to(device, non_blocking=True)), [requests[i] for i in keep], taken


def _seeded(device: torch.device, seed: int, fn: Any) -> Any:
    """``fn()`` with the default generator of ``device`` seeded with ``seed``, its state restored afterwards."""
    if device.type == "cuda":
        generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    else:
        generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        return fn()
    finally:
        generator.set_state(state)
