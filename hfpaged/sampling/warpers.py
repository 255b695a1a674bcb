"""transformers' sampling warpers (and ``renormalize_logits``) applied to many rows at once.

Each kind takes one parameter per row and computes, row by row, exactly what the transformers warper of the
same name computes for a batch of one (same operations, same order, float32); the rows may carry different
parameters. ``min_tokens_to_keep`` is always 1 here (it is larger only for beam search).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .processors import StageContext


def row_parameters(values: list[float], scores: torch.Tensor) -> torch.Tensor:
    """``[n, 1]`` tensor of one parameter per row, in the scores' dtype and on their device."""
    return torch.tensor(values, dtype=scores.dtype).to(scores.device, non_blocking=True)[:, None]


class Temperature:
    """``TemperatureLogitsWarper``: scores / temperature."""

    name = "temperature"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        return scores / row_parameters(payloads, scores)


class TopK:
    """``TopKLogitsWarper``: drop tokens below the k-th largest score."""

    name = "top_k"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[int], requests: list, context: StageContext) -> torch.Tensor:
        vocab_size = scores.shape[-1]
        ks = [min(k, vocab_size) for k in payloads]
        k_max = max(ks)
        top_values = torch.topk(scores, k_max, dim=-1).values
        if all(k == k_max for k in ks):
            kth = top_values[..., -1, None]
        else:
            index = torch.tensor([k - 1 for k in ks]).to(scores.device, non_blocking=True)[:, None]
            kth = top_values.gather(1, index)
        return scores.masked_fill(scores < kth, float("-inf"))


class TopP:
    """``TopPLogitsWarper``: keep the smallest set of top tokens holding ``top_p`` of the mass."""

    name = "top_p"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # transformers compares with the Python float (1 - top_p), i.e. that value cast to float32
        sorted_to_remove = cumulative_probs <= row_parameters([1 - p for p in payloads], scores)
        sorted_to_remove[..., -1:] = False
        to_remove = sorted_to_remove.scatter(1, sorted_indices, sorted_to_remove)
        return scores.masked_fill(to_remove, float("-inf"))


class MinP:
    """``MinPLogitsWarper``: drop tokens less likely than ``min_p`` times the top token."""

    name = "min_p"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        top_probs = probs.amax(dim=-1, keepdim=True)
        to_remove = probs < row_parameters(payloads, scores) * top_probs
        to_remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        return scores.masked_fill(to_remove, float("-inf"))


class Typical:
    """``TypicalLogitsWarper`` (locally typical sampling) with mass ``typical_p``."""

    name = "typical_p"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        normalized = torch.nn.functional.log_softmax(scores, dim=-1)
        p = torch.exp(normalized)
        ent = -(normalized * p).nansum(-1, keepdim=True)
        shifted_scores = torch.abs((-normalized) - ent)
        sorted_scores, sorted_indices = torch.sort(shifted_scores, descending=False)
        sorted_logits = scores.gather(-1, sorted_indices)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        last_ind = (cumulative_probs < row_parameters(payloads, scores)).sum(dim=1)
        last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
        sorted_to_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
        sorted_to_remove[..., :1] = False
        to_remove = sorted_to_remove.scatter(1, sorted_indices, sorted_to_remove)
        return scores.masked_fill(to_remove, float("-inf"))


def _below_top(scores: torch.Tensor) -> torch.Tensor:
    """True where a score is below the row's maximum (min_tokens_to_keep = 1)."""
    return scores < torch.topk(scores, 1)[0][..., -1, None]


class Epsilon:
    """``EpsilonLogitsWarper``: drop tokens with probability below ``epsilon_cutoff``."""

    name = "epsilon_cutoff"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        probabilities = scores.softmax(dim=-1)
        to_remove = (probabilities < row_parameters(payloads, scores)) & _below_top(scores)
        return scores.masked_fill(to_remove, float("-inf"))


class Eta:
    """``EtaLogitsWarper``: drop tokens below min(eta, sqrt(eta) * exp(-entropy))."""

    name = "eta_cutoff"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list[float], requests: list, context: StageContext) -> torch.Tensor:
        probabilities = scores.softmax(dim=-1)
        # torch.distributions.Categorical(logits=scores).entropy(), without its argument validation (a sync)
        logits = scores - scores.logsumexp(dim=-1, keepdim=True)
        entropy = -(torch.clamp(logits, min=torch.finfo(logits.dtype).min) * logits.softmax(dim=-1)).sum(-1)
        epsilon = torch.tensor(payloads, dtype=torch.float32).to(scores.device, non_blocking=True)
        eta = torch.min(epsilon, torch.sqrt(epsilon) * torch.exp(-entropy))[..., None]
        to_remove = (probabilities < eta) & _below_top(scores)
        return scores.masked_fill(to_remove, float("-inf"))


class Renormalize:
    """``LogitNormalization`` (``renormalize_logits=True``): log-softmax."""

    name = "renormalize_logits"
    reads_history = False

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        return scores.log_softmax(dim=-1)
