"""Parallel sampling (``num_return_sequences=n`` with ``do_sample=True``): one prefill, n samples.

The prompt is prefilled once, by the group's first request. The step that samples its first token
samples it n times: the parent's logits row is repeated for n - 1 child requests, each of which draws
with its own seed (``sample_seed(seed, i)``; sequence 0 keeps the request's seed) and keeps its own
processor state. The children then fork off the parent (``Scheduler.fork``): each takes one more
reference on every block of the prompt, and the last, partly filled block is copied on write when a
sequence first writes into it. From there every sequence decodes on its own, with its own stop
conditions - as ``generate`` treats the n rows it expands a prompt into.
"""

from __future__ import annotations

import dataclasses

import torch

from .logits_pipeline import Stage
from .request import Request

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded ``seed`` (index 0 keeps it; splitmix64 for the rest)."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % 2**62


def _own_stages(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """The stages with a private copy of every payload that keeps per-request state (it has ``fork``)."""
    return tuple(
        Stage(stage.kind, stage.payload.fork(), stage.rank) if hasattr(stage.payload, "fork") else stage
        for stage in stages
    )


class SampleGroup:
    """The n sequences of one prompt, parent first, in sample order."""

    def __init__(self, parent: Request, num_sequences: int):
        self.members = [parent]
        self.num_sequences = num_sequences
        parent.sample_group = self
        parent.num_forks_pending = num_sequences - 1

    def make_children(self) -> list[Request]:
        """The n - 1 other sequences, created when the parent samples its first token (nothing sampled yet)."""
        parent = self.members[0]
        children = []
        for index in range(1, self.num_sequences):
            params = dataclasses.replace(
                parent.params, seed=sample_seed(parent.params.seed, index), stages=_own_stages(parent.params.stages)
            )
            child = Request(f"{parent.request_id}.{index}", parent.prompt_token_ids, params, index=parent.index)
            child.sample_group = self
            child.sequence_index = index
            child.arrival_time = parent.arrival_time
            children.append(child)
        self.members += children
        parent.num_forks_pending = 0
        return children


def add_sample_rows(
    logits: torch.Tensor, requests: list[Request], unforked: set[Request]
) -> tuple[torch.Tensor, list[Request], dict[str, list[Request]]]:
    """Give every parent in ``requests`` that samples its first token here its children, and them its row.

    Returns the logits and requests with the children's rows appended, and the children by parent id.
    """
    rows: list[int] = []
    extra: list[Request] = []
    forks: dict[str, list[Request]] = {}
    for row, request in enumerate(requests):
        if request in unforked:
            unforked.discard(request)
            children = request.sample_group.make_children()
            forks[request.request_id] = children
            rows += [row] * len(children)
            extra += children
    if not rows:
        return logits, requests, forks
    index = torch.tensor(rows).to(logits.device, non_blocking=True)
    return torch.cat([logits, logits.index_select(0, index)]), requests + extra, forks
