"""Processors that ban or bias particular token ids, decided on the host from each request's own ids.

Each request keeps a small index (n-gram table, biased-sequence table) that it updates with the tokens it
gained since the last step, so a step costs O(1) host work per request; the device then gets one scatter
for the whole batch. Semantics follow the transformers processor named in each docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .logits_pipeline import StageContext


def _fill(scores: torch.Tensor, rows: list[int], cols: list[int], value: float) -> torch.Tensor:
    """``scores`` with ``value`` written at every ``(rows[i], cols[i])``."""
    if not rows:
        return scores
    index = torch.tensor([rows, cols]).to(scores.device, non_blocking=True)
    return scores.index_put((index[0], index[1]), torch.tensor(value, dtype=scores.dtype, device=scores.device))


# --- n-gram bans -----------------------------------------------------------------------------------


class NgramIndex:
    """For one request: each (n-1)-token prefix seen so far -> the tokens that followed it."""

    def __init__(self, ngram_size: int):
        self.ngram_size = ngram_size
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self.num_indexed = 0  # ids[:num_indexed] have had their n-grams recorded

    def fork(self) -> NgramIndex:
        """An independent copy for a sequence that forks off this request (parallel sampling)."""
        copy = NgramIndex(self.ngram_size)
        copy.followers = {prefix: set(tokens) for prefix, tokens in self.followers.items()}
        copy.num_indexed = self.num_indexed
        return copy

    def banned(self, ids: list[int]) -> set[int] | tuple:
        """Tokens that would repeat an n-gram of ``ids`` (``NoRepeatNGramLogitsProcessor``)."""
        n = self.ngram_size
        length = len(ids)
        if length < n:
            return ()
        for end in range(max(self.num_indexed + 1, n), length + 1):
            self.followers.setdefault(tuple(ids[end - n : end - 1]), set()).add(ids[end - 1])
        self.num_indexed = length
        return self.followers.get(tuple(ids[length + 1 - n :]), ())


class NoRepeatNgram:
    """``NoRepeatNGramLogitsProcessor``: an n-gram never occurs twice in prompt + output. Payload: NgramIndex."""

    name = "no_repeat_ngram_size"

    def apply(
        self, scores: torch.Tensor, payloads: list[NgramIndex], requests: list, context: StageContext
    ) -> torch.Tensor:
        vocab_size = scores.shape[-1]
        rows, cols = [], []
        for row, (index, request) in enumerate(zip(payloads, requests)):
            for token_id in index.banned(request.all_token_ids):
                if token_id < vocab_size:
                    rows.append(row)
                    cols.append(token_id)
        return _fill(scores, rows, cols, float("-inf"))


# --- sequence biases (sequence_bias, bad_words_ids) ------------------------------------------------


class SequenceBiasIndex:
    """One request's biased sequences: single tokens as tensors, longer ones by prefix for suffix lookups."""

    def __init__(self, sequence_bias: dict[tuple[int, ...], float], skip_when_sequence_longer: bool):
        singles = [(seq[0], bias) for seq, bias in sequence_bias.items() if len(seq) == 1]
        self.single_ids = torch.tensor([t for t, _ in singles], dtype=torch.long)
        self.single_values = torch.tensor([b for _, b in singles], dtype=torch.float32)
        self.by_prefix_length: dict[int, dict[tuple[int, ...], list[tuple[int, float]]]] = {}
        for seq, bias in sequence_bias.items():
            if len(seq) > 1:
                table = self.by_prefix_length.setdefault(len(seq) - 1, {})
                table.setdefault(tuple(seq[:-1]), []).append((seq[-1], bias))
        # transformers <= 5.17 skips a sequence longer than the ids; later versions only one whose prefix is
        self.skip_when_sequence_longer = skip_when_sequence_longer

    def matches(self, ids: list[int]) -> list[tuple[int, float]]:
        """(last token, bias) of every multi-token sequence whose prefix ends ``ids``."""
        found = []
        length = len(ids)
        for prefix_length, table in self.by_prefix_length.items():
            needed = prefix_length + 1 if self.skip_when_sequence_longer else prefix_length
            if needed > length:
                continue
            found.extend(table.get(tuple(ids[length - prefix_length :]), ()))
        return found


class SequenceBias:
    """``SequenceBiasLogitsProcessor`` / ``NoBadWordsLogitsProcessor`` (bias -inf). Payload: SequenceBiasIndex."""

    def __init__(self, name: str):
        self.name = name

    def apply(
        self, scores: torch.Tensor, payloads: list[SequenceBiasIndex], requests: list, context: StageContext
    ) -> torch.Tensor:
        # transformers builds a float32 bias (single tokens first, then matched sequences) and adds it once
        bias = torch.zeros_like(scores)
        num_singles = [len(index.single_ids) for index in payloads]
        if any(num_singles):
            rows = torch.repeat_interleave(torch.arange(len(payloads)), torch.tensor(num_singles))
            cols = torch.cat([index.single_ids for index in payloads])
            values = torch.cat([index.single_values for index in payloads])
            bias = _add_at(bias, rows, cols, values)
        rows, cols, values = [], [], []
        for row, (index, request) in enumerate(zip(payloads, requests)):
            if index.by_prefix_length:
                for token_id, value in index.matches(request.all_token_ids):
                    rows.append(row)
                    cols.append(token_id)
                    values.append(value)
        if rows:
            bias = _add_at(bias, torch.tensor(rows), torch.tensor(cols), torch.tensor(values, dtype=torch.float32))
        return scores + bias


def _add_at(target: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    device = target.device
    index = torch.stack([rows, cols]).to(device, non_blocking=True)
    return target.index_put((index[0], index[1]), values.to(device, target.dtype, non_blocking=True), accumulate=True)


# --- fixed token sets, active under a length condition -------------------------------------------


class SuppressTokens:
    """``SuppressTokensLogitsProcessor`` / ``SuppressTokensAtBeginLogitsProcessor`` /
    ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: set token ids to -inf while a
    length condition holds. Payload: ``(token_ids, min_length, exact_length)``: active when
    ``num_tokens < min_length`` (if set) and ``num_tokens == exact_length`` (if set).
    """

    def __init__(self, name: str):
        self.name = name

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        rows, cols = [], []
        for row, ((token_ids, min_length, exact_length), request) in enumerate(zip(payloads, requests)):
            num_tokens = request.num_tokens
            if min_length is not None and num_tokens >= min_length:
                continue
            if exact_length is not None and num_tokens != exact_length:
                continue
            rows.extend([row] * len(token_ids))
            cols.extend(token_ids)
        return _fill(scores, rows, cols, float("-inf"))
