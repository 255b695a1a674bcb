"""Runs every request's logits processors over one batch of rows, batching the kinds that allow it.

Each request carries ``params.stages``: its logits processors in transformers' order. A stage with a
``rank`` is a batched kind (its rank is its place in transformers' fixed processor order); a stage without
one runs on that request's row alone. Every row applies its own stages in its own order, so running the
batched kinds rank by rank, and each unranked stage right after the ranked stage that precedes it in its
row, gives every row exactly what transformers computes for it alone. When every row has the same schedule
(one setting for the whole batch, the usual case) the stages simply run in order on all rows.

The plan: turns the logits processors transformers builds for one request into that request's stages.

transformers' ``_get_logits_processor`` fixes the order: sequence_bias, encoder_repetition_penalty,
repetition_penalty, no_repeat_ngram_size, encoder_no_repeat_ngram_size, bad_words_ids, min_length,
min_new_tokens, prefix_allowed_tokens_fn, forced_bos/eos, remove_invalid_values,
exponential_decay_length_penalty, suppress_tokens, begin_suppress_tokens, your ``logits_processor=`` list,
then (sampling only) temperature, top_h, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff, then a
watermark, then renormalize_logits. hfpaged adds vLLM's presence/frequency penalties and ``logit_bias``
right after your processors, before the first warper (or renormalization).

Processors of a type listed in ``_BATCHED`` (built by transformers, not passed by the user) become batched
stages with the same semantics; everything else — your own processors included — runs row by row on the
request's own full ids, exactly as ``generate`` would call it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers.generation import logits_process as lp

from .penalties import (
    EncoderRepetitionPenalty,
    LogitBias,
    PresenceFrequencyPenalty,
    RepetitionPenalty,
    TokenCountTable,
)
from .token_bans import NgramIndex, NoRepeatNgram, SequenceBias, SequenceBiasIndex, SuppressTokens
from .warpers import Epsilon, Eta, MinP, Renormalize, Temperature, TopK, TopP, Typical

if TYPE_CHECKING:
    from .request_state import CachedRequestState


class StageKind(Protocol):
    """A logits-processing step that can run on many rows at once (one payload per row)."""

    name: str
    reads_history: bool  # whether it looks at the request's tokens (absent: assumed True)

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        """Processed ``scores`` ``[len(requests), vocab]``; ``payloads[i]`` holds row i's settings."""


@dataclass(frozen=True)
class Stage:
    """One processor of one request: its kind, its per-request data, and its rank (None: row by row)."""

    kind: StageKind
    payload: Any
    rank: int | None


_SCHEDULES: dict[tuple, tuple] = {}


def stage_schedule(stages: tuple[Stage, ...]) -> tuple:
    """The order keys of a request's stages (see ``run_stages``), interned: equal schedules are one object."""
    keys, previous_rank = [], -1
    for position, stage in enumerate(stages):
        if stage.rank is not None:
            keys.append((stage.rank, 0, 0, ""))
            previous_rank = stage.rank
        else:
            keys.append((previous_rank, 1, position, stage.kind.name))
    schedule = tuple(keys)
    return _SCHEDULES.setdefault(schedule, schedule)


class StageContext:
    """What stages share within one engine: device token statistics and this step's id tensors."""

    def __init__(self, vocab_size: int, device: torch.device):  # vocab_size: the width of the logits
        self.device = device
        self.token_counts = TokenCountTable(vocab_size, device)
        self._ids: dict[int, torch.Tensor] = {}
        self.failures: dict[str, BaseException] = {}  # this step (Sampler.sample resets it): id -> what raised

    def begin_step(self) -> None:
        """Forget last step's id tensors (requests have grown since)."""
        self._ids.clear()

    def ids_tensor(self, request: CachedRequestState) -> torch.Tensor:
        """``[1, num_tokens]`` prompt + output ids on the device (built once per step per request)."""
        ids = self._ids.get(id(request))
        if ids is None:
            ids = torch.tensor([request.all_token_ids], dtype=torch.long).to(self.device, non_blocking=True)
            self._ids[id(request)] = ids
        return ids


class HFProcessor:
    """The exact path: call the transformers (or user) processor on the request's own full ids."""

    name = "hf"

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: StageContext) -> torch.Tensor:
        out = scores.clone()
        for row, (processor, request) in enumerate(zip(payloads, requests)):
            if request.request_id in context.failures:
                continue
            try:
                out[row : row + 1] = processor(context.ids_tensor(request), out[row : row + 1])
            except Exception as error:  # a user processor's bug fails its own request, not the step
                context.failures[request.request_id] = error
        return out


HF_PROCESSOR = HFProcessor()


def run_stages(scores: torch.Tensor, requests: list[CachedRequestState], context: StageContext) -> torch.Tensor:
    """Apply each row's stages to ``scores`` ``[len(requests), vocab]``; returns the processed scores."""
    schedule = requests[0].params.stage_schedule
    if all(r.params.stage_schedule is schedule for r in requests):
        # the common case (one setting for the whole batch): every stage runs on all rows, in row order
        for position in range(len(schedule)):
            kind = requests[0].params.stages[position].kind
            payloads = [r.params.stages[position].payload for r in requests]
            scores = kind.apply(scores, payloads, requests, context)
        return scores
    groups: dict[tuple, tuple[StageKind, list[int], list]] = {}
    for row, request in enumerate(requests):
        stages = request.params.stages
        for position, key in enumerate(request.params.stage_schedule):
            stage = stages[position]
            group = groups.get(key)
            if group is None:
                group = groups[key] = (stage.kind, [], [])
            group[1].append(row)
            group[2].append(stage.payload)
    num_rows = len(requests)
    for key in sorted(groups):
        kind, rows, payloads = groups[key]
        if len(rows) == num_rows:
            scores = kind.apply(scores, payloads, requests, context)
        else:
            index = torch.tensor(rows).to(scores.device, non_blocking=True)
            sub = kind.apply(scores.index_select(0, index), payloads, [requests[i] for i in rows], context)
            scores = scores.index_copy(0, index, sub)
    return scores


# --- the plan: transformers' processors -> stages ----------------------------------------

SEQUENCE_BIAS = SequenceBias("sequence_bias")
ENCODER_REPETITION = EncoderRepetitionPenalty()
REPETITION = RepetitionPenalty()
NO_REPEAT_NGRAM = NoRepeatNgram()
BAD_WORDS = SequenceBias("bad_words_ids")
MIN_LENGTH = SuppressTokens("min_length")
MIN_NEW_TOKENS = SuppressTokens("min_new_tokens")
SUPPRESS = SuppressTokens("suppress_tokens")
BEGIN_SUPPRESS = SuppressTokens("begin_suppress_tokens")
PRESENCE_FREQUENCY = PresenceFrequencyPenalty()
LOGIT_BIAS = LogitBias()
TEMPERATURE = Temperature()
TOP_K = TopK()
TOP_P = TopP()
MIN_P = MinP()
TYPICAL = Typical()
EPSILON = Epsilon()
ETA = Eta()
RENORMALIZE = Renormalize()

# Batched kinds in transformers' order (their rank is their index here).
_ORDER = (
    SEQUENCE_BIAS,
    ENCODER_REPETITION,
    REPETITION,
    NO_REPEAT_NGRAM,
    BAD_WORDS,
    MIN_LENGTH,
    MIN_NEW_TOKENS,
    SUPPRESS,
    BEGIN_SUPPRESS,
    PRESENCE_FREQUENCY,
    LOGIT_BIAS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    MIN_P,
    TYPICAL,
    EPSILON,
    ETA,
    RENORMALIZE,
)
_RANK = {id(kind): rank for rank, kind in enumerate(_ORDER)}

# Where hfpaged's vLLM-style adjustments go: before the first of these (or at the end).
_AFTER_ADJUSTMENTS = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopHLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "WatermarkLogitsProcessor",
        "SynthIDTextWatermarkLogitsProcessor",
        "LogitNormalization",
    )
    if hasattr(lp, name)
)


def _keeps_one(processor: Any) -> bool:
    return (
        getattr(processor, "min_tokens_to_keep", 1) == 1 and getattr(processor, "filter_value", -math.inf) == -math.inf
    )


def _token_list(ids: Any, vocab_size: int) -> list[int]:
    """Distinct ids (int, list or tensor) that exist in the vocabulary (``torch.isin`` ignores the others)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    elif isinstance(ids, int):
        ids = [ids]
    return sorted({int(t) for t in ids if 0 <= int(t) < vocab_size})


def _sequence_bias_index(processor: Any, vocab_size: int) -> SequenceBiasIndex:
    bias = processor.sequence_bias
    if isinstance(bias, list):  # not yet converted by the processor (older layouts)
        bias = {tuple(seq): value for seq, value in bias}
    invalid = [t for seq in bias for t in seq if t >= vocab_size]
    if invalid:
        raise ValueError(
            f"The model vocabulary size is {vocab_size}, but the following tokens were being biased: {invalid}"
        )
    return SequenceBiasIndex(bias, skip_when_sequence_longer=not hasattr(processor, "multi_token_biases"))


def _batched_stage(processor: Any, vocab_size: int) -> tuple[Any, Any] | None:
    """``(kind, payload)`` for a transformers-built processor we batch exactly, else None."""
    kind_of = type(processor)
    if kind_of is lp.TemperatureLogitsWarper:
        return TEMPERATURE, float(processor.temperature)
    if kind_of is lp.TopKLogitsWarper and _keeps_one(processor):
        return TOP_K, int(processor.top_k)
    if kind_of is lp.TopPLogitsWarper and _keeps_one(processor):
        return TOP_P, float(processor.top_p)
    if kind_of is lp.MinPLogitsWarper and _keeps_one(processor):
        return MIN_P, float(processor.min_p)
    if kind_of is lp.TypicalLogitsWarper and _keeps_one(processor):
        return TYPICAL, float(processor.mass)
    if kind_of is lp.EpsilonLogitsWarper and _keeps_one(processor):
        return EPSILON, float(processor.epsilon)
    if kind_of is lp.EtaLogitsWarper and _keeps_one(processor):
        return ETA, float(processor.epsilon)
    if kind_of is lp.LogitNormalization:
        return RENORMALIZE, None
    if kind_of is lp.RepetitionPenaltyLogitsProcessor:
        if processor.prompt_ignore_length is None or (
            isinstance(processor.prompt_ignore_length, int) and processor.prompt_ignore_length == 0
        ):
            return REPETITION, float(processor.penalty)
        return None
    if kind_of is lp.EncoderRepetitionPenaltyLogitsProcessor:
        return ENCODER_REPETITION, float(processor.penalty)
    if kind_of is lp.NoRepeatNGramLogitsProcessor:
        return NO_REPEAT_NGRAM, NgramIndex(processor.ngram_size)
    if kind_of is lp.SequenceBiasLogitsProcessor:
        return SEQUENCE_BIAS, _sequence_bias_index(processor, vocab_size)
    if kind_of is lp.NoBadWordsLogitsProcessor:
        return BAD_WORDS, _sequence_bias_index(processor, vocab_size)
    if kind_of is lp.MinLengthLogitsProcessor:
        return MIN_LENGTH, (_token_list(processor.eos_token_id, vocab_size), processor.min_length, None)
    if kind_of is lp.MinNewTokensLengthLogitsProcessor:
        min_length = processor.prompt_length_to_skip + processor.min_new_tokens
        return MIN_NEW_TOKENS, (_token_list(processor.eos_token_id, vocab_size), min_length, None)
    if kind_of is lp.SuppressTokensLogitsProcessor:
        return SUPPRESS, (_token_list(processor.suppress_tokens, vocab_size), None, None)
    if kind_of is lp.SuppressTokensAtBeginLogitsProcessor:
        return BEGIN_SUPPRESS, (_token_list(processor.begin_suppress_tokens, vocab_size), None, processor.begin_index)
    return None


def adjustment_stages(
    presence_penalty: float, frequency_penalty: float, logit_bias: dict[int, float] | None
) -> list[tuple[Any, Any]]:
    """vLLM-style ``(kind, payload)`` pairs for the given settings (none when they are all off)."""
    stages: list[tuple[Any, Any]] = []
    if presence_penalty or frequency_penalty:
        stages.append((PRESENCE_FREQUENCY, (float(presence_penalty), float(frequency_penalty))))
    if logit_bias:
        ids = torch.tensor(list(logit_bias.keys()), dtype=torch.long)
        values = torch.tensor([float(v) for v in logit_bias.values()], dtype=torch.float32)
        stages.append((LOGIT_BIAS, (ids, values)))
    return stages


def plan_stages(
    processors: lp.LogitsProcessorList,
    *,
    user_processors: list | None,
    adjustments: list[tuple[Any, Any]],
    vocab_size: int,
) -> tuple[Stage, ...]:
    """One request's stages, in transformers' order with hfpaged's adjustments placed as documented above."""
    user_ids = {id(p) for p in user_processors or ()}
    pairs: list[tuple[Any, Any]] = []
    placed = not adjustments
    for processor in processors:
        if not placed and isinstance(processor, _AFTER_ADJUSTMENTS):
            pairs.extend(adjustments)
            placed = True
        batched = None if id(processor) in user_ids else _batched_stage(processor, vocab_size)
        pairs.append(batched if batched is not None else (HF_PROCESSOR, processor))
    if not placed:
        pairs.extend(adjustments)
    stages, last_rank = [], -1
    for kind, payload in pairs:
        rank = _RANK.get(id(kind))
        if rank is not None and rank <= last_rank:
            rank = None  # out of transformers' usual order: run it row by row where it stands
        if rank is not None:
            last_rank = rank
        stages.append(Stage(kind, payload, rank))
    return tuple(stages)


def wrap_prefix_allowed_tokens_fn(fn: Callable[[int, torch.Tensor], list[int]], batch_id: int) -> Callable:
    """``prefix_allowed_tokens_fn`` seeing the prompt's position as ``batch_id``, as in a batched ``generate``."""

    def for_this_prompt(_: int, input_ids: torch.Tensor) -> list[int]:
        return fn(batch_id, input_ids)

    return for_this_prompt
