"""Batched token selection: greedy, and sampling with transformers' warpers reproduced on the device.

Sampling uses the Gumbel-max trick (``argmax(scores + Gumbel noise)`` draws from ``softmax(scores)``)
with noise from a counter-based hash of (request seed, token position, vocab index). So a request's
draws depend only on its own seed and progress - never on which requests share the batch or on how
the scheduler split the work - and no device sync is needed to sample.
"""

from __future__ import annotations

import torch

from .request import Request

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2^32.

    The multipliers are below 2^31, so every product stays below 2^63: no signed overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 16)
    return x


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[N, vocab_size]`` determined by (seed, counter, vocab index) alone."""
    device = seeds.device
    seeds = seeds.to(torch.int64)
    row_key = _mix32(((seeds >> 32) & _MASK32) ^ _mix32(counters.to(torch.int64) & _MASK32))
    row_key = _mix32(row_key ^ (seeds & _MASK32))
    col = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x9E3779B9)
    bits = _mix32(col[None, :] ^ row_key[:, None])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -torch.log(-torch.log(uniform))


def apply_warpers(scores: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p per row, exactly as transformers' warpers (in that order)."""
    device = scores.device
    params = [r.params for r in requests]
    temperature = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=device)
    scores = scores / temperature[:, None]

    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = scores.shape[-1]
        k_rows = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=device)
        k_max = int(k_rows.max())
        kth = torch.topk(scores, k_max, dim=-1).values.gather(1, (k_rows - 1)[:, None])
        use = torch.tensor([k > 0 for k in top_ks], device=device)[:, None]
        scores = scores.masked_fill(use & (scores < kth), float("-inf"))

    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        # transformers compares against the Python float (1 - top_p), cast to the scores' dtype.
        threshold = torch.tensor([1 - p for p in top_ps], dtype=scores.dtype, device=device)[:, None]
        use = torch.tensor([p < 1.0 for p in top_ps], device=device)[:, None]
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = (cumulative <= threshold) & use
        remove_sorted[:, -1:] = False
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))

    min_ps = [p.min_p for p in params]
    if any(p is not None for p in min_ps):
        min_p = torch.tensor([p if p is not None else 0.0 for p in min_ps], dtype=scores.dtype, device=device)
        probs = torch.softmax(scores, dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        sorted_indices = torch.argsort(scores, descending=True, dim=-1)
        remove_sorted = torch.gather(remove, dim=-1, index=sorted_indices)
        remove_sorted[:, :1] = False
        remove = remove_sorted.scatter(1, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


class Sampler:
    """Picks one token per row of last-position logits; one device-to-host copy per call."""

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        scores = logits.float()
        rows_hf = [i for i, r in enumerate(requests) if r.params.needs_processors]
        for i in rows_hf:
            request = requests[i]
            ids = torch.tensor([request.all_token_ids], dtype=torch.long, device=scores.device)
            scores[i : i + 1] = request.params.logits_processor(ids, scores[i : i + 1])

        sample_rows = [i for i, r in enumerate(requests) if r.params.do_sample]
        tokens = scores.argmax(dim=-1)
        if sample_rows:
            rows = torch.tensor(sample_rows, device=scores.device)
            sub = scores.index_select(0, rows)
            warped = [i for i in sample_rows if not requests[i].params.needs_processors]
            if warped:
                pos = [sample_rows.index(i) for i in warped]
                pos_t = torch.tensor(pos, device=scores.device)
                sub[pos_t] = apply_warpers(sub[pos_t], [requests[i] for i in warped])
            seeds = torch.tensor([requests[i].params.seed for i in sample_rows], device=scores.device)
            counters = torch.tensor([requests[i].num_tokens for i in sample_rows], device=scores.device)
            noise = gumbel_noise(seeds, counters, sub.shape[-1])
            tokens[rows] = (sub + noise).argmax(dim=-1)
        return tokens.tolist()
