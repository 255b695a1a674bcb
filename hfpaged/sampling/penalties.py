"""History penalties on the device: transformers' repetition penalties and vLLM's presence/frequency/logit_bias.

They read which tokens a request has seen from a ``TokenCountTable``: device token statistics per live
request, kept up to date incrementally (only the tokens a request appended since the last step are
scattered in), so a step costs O(new tokens) host work however long the requests are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .warpers import row_parameters

if TYPE_CHECKING:
    from .processors import StageContext


class RepetitionPenalty:
    """``RepetitionPenaltyLogitsProcessor``: every token of prompt + output, once: x*p if x < 0 else x/p."""

    name = "repetition_penalty"

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        seen = table.prompt_mask[slots] | (table.output_counts[slots] > 0)
        penalty = row_parameters(payloads, scores)
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        return torch.where(seen, penalized, scores)


class EncoderRepetitionPenalty:
    """``EncoderRepetitionPenaltyLogitsProcessor`` over the prompt (payload: transformers' inverted penalty)."""

    name = "encoder_repetition_penalty"

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        seen = table.prompt_mask[slots]
        penalty = row_parameters(payloads, scores)
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        return torch.where(seen, penalized, scores)


class PresenceFrequencyPenalty:
    """vLLM's penalties over generated tokens: x - frequency * count - presence * (count > 0).

    Payload: ``(presence_penalty, frequency_penalty)``.
    """

    name = "presence_frequency_penalty"

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        counts = table.output_counts[slots]
        presence = row_parameters([p for p, _ in payloads], scores)
        frequency = row_parameters([f for _, f in payloads], scores)
        return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


class LogitBias:
    """vLLM's ``logit_bias``: add a fixed value to chosen token ids. Payload: ``(token_ids, values)`` tensors."""

    name = "logit_bias"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        rows = torch.repeat_interleave(torch.arange(len(payloads)), torch.tensor([len(ids) for ids, _ in payloads]))
        cols = torch.cat([ids for ids, _ in payloads])
        values = torch.cat([v for _, v in payloads]).to(scores.dtype)
        device = scores.device
        index = torch.stack([rows, cols]).to(device, non_blocking=True)
        return scores.index_put((index[0], index[1]), values.to(device, non_blocking=True), accumulate=True)


class TokenCountTable:
    """``prompt_mask[slot, v]`` (v occurs in the prompt) and ``output_counts[slot, v]`` (times v was generated).

    A request takes a slot the first time a stage needs it; slots of finished requests are reused when the
    table is full, and the table doubles when none is free.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = 0
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.slot_of: dict[Any, int] = {}
        self.num_counted: dict[Any, int] = {}
        self.free_slots: list[int] = []

    def _take_slot(self, request: Any) -> int:
        if not self.free_slots:
            for owner in [r for r in self.slot_of if r.is_finished]:
                self.free_slots.append(self.slot_of.pop(owner))
                del self.num_counted[owner]
        if not self.free_slots:
            self._grow(max(8, 2 * self.capacity))
        slot = self.free_slots.pop()
        self.slot_of[request] = slot
        self.num_counted[request] = 0
        return slot

    def _reallocate(self, capacity: int, vocab_size: int) -> None:
        """New tables of ``capacity`` slots x ``vocab_size`` ids holding what both shapes share."""
        rows, cols = min(capacity, self.capacity), min(vocab_size, self.vocab_size)
        prompt_mask = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        output_counts = torch.zeros(capacity, vocab_size, dtype=torch.float32, device=self.device)
        prompt_mask[:rows, :cols] = self.prompt_mask[:rows, :cols]
        output_counts[:rows, :cols] = self.output_counts[:rows, :cols]
        self.prompt_mask, self.output_counts, self.vocab_size = prompt_mask, output_counts, vocab_size

    def _grow(self, capacity: int) -> None:
        self._reallocate(capacity, self.vocab_size)
        self.free_slots.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    def resize(self, vocab_size: int) -> None:
        """Another vocabulary width (``resize_token_embeddings``): counts of the ids both widths hold are kept."""
        if vocab_size != self.vocab_size:
            self._reallocate(self.capacity, vocab_size)

    def slots_for(self, requests: list[Any]) -> torch.Tensor:
        """The requests' slots ``[n]`` on the device, after counting every token they gained since last time."""
        slots, new_slots = [], []
        prompt_rows, prompt_cols, output_rows, output_cols = [], [], [], []
        vocab_size = self.vocab_size
        for request in requests:
            slot = self.slot_of.get(request)
            if slot is None:
                slot = self._take_slot(request)
                new_slots.append(slot)
            slots.append(slot)
            counted = self.num_counted[request]
            num_tokens = request.num_tokens
            if counted == num_tokens:
                continue
            prompt_len = request.num_prompt_tokens
            ids = request.all_token_ids
            for position in range(counted, num_tokens):
                token_id = ids[position]
                if token_id >= vocab_size:
                    continue  # cannot be produced by the head: nothing to penalize
                if position < prompt_len:
                    prompt_rows.append(slot)
                    prompt_cols.append(token_id)
                else:
                    output_rows.append(slot)
                    output_cols.append(token_id)
            self.num_counted[request] = num_tokens
        device = self.device
        if new_slots:
            index = torch.tensor(new_slots).to(device, non_blocking=True)
            self.prompt_mask.index_fill_(0, index, False)
            self.output_counts.index_fill_(0, index, 0.0)
        if prompt_rows:
            index = torch.tensor([prompt_rows, prompt_cols]).to(device, non_blocking=True)
            self.prompt_mask.index_put_((index[0], index[1]), torch.tensor(True, device=device))
        if output_rows:
            index = torch.tensor([output_rows, output_cols]).to(device, non_blocking=True)
            ones = torch.ones(len(output_rows), dtype=torch.float32, device=device)
            self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)
        return torch.tensor(slots).to(device, non_blocking=True)
