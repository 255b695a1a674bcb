"""Parallel sampling (``num_return_sequences=n`` with ``do_sample=True``): one prefill, n samples.

The prompt is prefilled once, by the group's first request. The step that samples its first token
samples it n times: the runner repeats the parent's logits row for the n - 1 other sequences, each of
which draws with its own seed (``sample_seed(seed, i)``; sequence 0 keeps the request's seed) and keeps its
own processor state (``child_params``). The scheduler then forks them off the parent
(``KVManager.fork``): each takes one more reference on every block of the prompt, and the last, partly
filled block is copied on write when a sequence first writes into it. From there every sequence decodes
on its own, with its own stop conditions - as ``generate`` treats the n rows it expands a prompt into.
"""

from __future__ import annotations

import copy
import dataclasses

from transformers import SynthIDTextWatermarkLogitsProcessor

from .params import RequestParams
from .processors import Stage

_MASK64 = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request seeded ``seed`` (index 0 keeps it; splitmix64 for the rest)."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) % 2**62


# transformers' processors whose state follows the rows they have seen (``generate`` calls one with a prompt's n rows,
# each row's state its own): each sequence, called alone, takes a private copy
STATEFUL_PROCESSORS = (SynthIDTextWatermarkLogitsProcessor,)


def child_params(params: RequestParams, index: int) -> RequestParams:
    """Settings of sequence ``index`` forking off a request with ``params``: its own seed, and a private copy
    of every processor payload that keeps per-request state (it has ``fork``, or is one of STATEFUL_PROCESSORS)."""
    stages = tuple(
        Stage(stage.kind, _fork(stage.payload), stage.rank)
        if hasattr(stage.payload, "fork") or isinstance(stage.payload, STATEFUL_PROCESSORS)
        else stage
        for stage in params.stages
    )
    return dataclasses.replace(params, seed=sample_seed(params.seed, index), stages=stages)


def _fork(payload):
    return payload.fork() if hasattr(payload, "fork") else copy.deepcopy(payload)
