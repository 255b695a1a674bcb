"""History penalties on the device: transformers' repetition penalties and vLLM's presence/frequency/logit_bias.

They read which tokens a request has seen from the engine's ``TokenCountTable`` (``token_counts``), so a
step costs O(new tokens) host work however long the requests are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .logits_pipeline import row_parameters as _row_values

if TYPE_CHECKING:
    from .logits_pipeline import StageContext


class RepetitionPenalty:
    """``RepetitionPenaltyLogitsProcessor``: every token of prompt + output, once: x*p if x < 0 else x/p."""

    name = "repetition_penalty"

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: "StageContext") -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        seen = table.prompt_mask[slots] | (table.output_counts[slots] > 0)
        penalty = _row_values(payloads, scores)
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        return torch.where(seen, penalized, scores)


class EncoderRepetitionPenalty:
    """``EncoderRepetitionPenaltyLogitsProcessor`` over the prompt (payload: transformers' inverted penalty)."""

    name = "encoder_repetition_penalty"

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: "StageContext") -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        seen = table.prompt_mask[slots]
        penalty = _row_values(payloads, scores)
        penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
        return torch.where(seen, penalized, scores)


class PresenceFrequencyPenalty:
    """vLLM's penalties over generated tokens: x - frequency * count - presence * (count > 0).

    Payload: ``(presence_penalty, frequency_penalty)``.
    """

    name = "presence_frequency_penalty"

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: "StageContext") -> torch.Tensor:
        table = context.token_counts
        slots = table.slots_for(requests)
        counts = table.output_counts[slots]
        presence = _row_values([p for p, _ in payloads], scores)
        frequency = _row_values([f for _, f in payloads], scores)
        return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)


class LogitBias:
    """vLLM's ``logit_bias``: add a fixed value to chosen token ids. Payload: ``(token_ids, values)`` tensors."""

    name = "logit_bias"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: "StageContext") -> torch.Tensor:
        rows = torch.repeat_interleave(torch.arange(len(payloads)), torch.tensor([len(ids) for ids, _ in payloads]))
        cols = torch.cat([ids for ids, _ in payloads])
        values = torch.cat([v for _, v in payloads]).to(scores.dtype)
        device = scores.device
        index = torch.stack([rows, cols]).to(device, non_blocking=True)
        return scores.index_put((index[0], index[1]), values.to(device, non_blocking=True), accumulate=True)
