"""Runs every request's logits processors over one batch of rows, batching the kinds that allow it.

Each request carries ``params.stages``: its logits processors in transformers' order. A stage with a
``rank`` is a batched kind (its rank is its place in transformers' fixed processor order); a stage without
one runs on that request's row alone. Every row applies its own stages in its own order, so running the
batched kinds rank by rank, and each unranked stage right after the ranked stage that precedes it in its
row, gives every row exactly what transformers computes for it alone. When every row has the same schedule
(one setting for the whole batch, the usual case) the stages simply run in order on all rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .token_counts import TokenCountTable

if TYPE_CHECKING:
    from .request import Request


class StageKind(Protocol):
    """A logits-processing step that can run on many rows at once (one payload per row)."""

    name: str
    reads_history: bool  # whether it looks at the request's tokens (absent: assumed True)

    def apply(self, scores: torch.Tensor, payloads: list, requests: list, context: "StageContext") -> torch.Tensor:
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


def row_parameters(values: list[float], scores: torch.Tensor) -> torch.Tensor:
    """``[n, 1]`` tensor of one parameter per row, in the scores' dtype and on their device."""
    return torch.tensor(values, dtype=scores.dtype).to(scores.device, non_blocking=True)[:, None]


class StageContext:
    """What stages share within one engine: device token statistics and this step's id tensors."""

    def __init__(self, vocab_size: int, device: torch.device):  # vocab_size: the width of the logits
        self.device = device
        self.token_counts = TokenCountTable(vocab_size, device)
        self._ids: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        """Forget last step's id tensors (requests have grown since)."""
        self._ids.clear()

    def ids_tensor(self, request: "Request") -> torch.Tensor:
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
            out[row : row + 1] = processor(context.ids_tensor(request), out[row : row + 1])
        return out


HF_PROCESSOR = HFProcessor()


def run_stages(scores: torch.Tensor, requests: list["Request"], context: StageContext) -> torch.Tensor:
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
