"""Requests that would run past a model's learned absolute position table (GPT-2's ``wpe``, OPT's
``embed_positions``, ...: ``model.kv_cache.position_table`` finds it at ``patch``).

Stock ``generate`` raises ``IndexError`` for such a request when it forwards the token at the first position
past the table (a device-side assert on CUDA, which poisons the process). A paged step packs many requests, so
that forward would fail every request of the step, other callers' included. The scheduler instead finishes the
request alone with a clear ``IndexError`` as soon as a token it would forward sits past the table (after the stop
checks: a request that stops there, at an eos or its length, completes as in stock), so no step ever holds that
token; the placeholder of an overlapped step past the table is not planned ahead either
(``Scheduler.max_model_len``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..outputs import RequestOutput, progress_output
from ..sampling.params import prompt_name
from .request import Request

if TYPE_CHECKING:
    from .runner_output import BeamRound
    from .scheduler import Scheduler


def past_table_error(request: Request, positions: int, table: str) -> IndexError:
    """The error of ``request``, whose next forward would be at a position the table has no row for."""
    position = len(request.all_token_ids) - 1
    name = prompt_name(request.index) if request.index is not None else f"request {request.prompt_id!r}"
    return IndexError(
        f"{name} runs past the model's learned position table: its next token is at position "
        f"{position}, and the table ({table}) has rows for positions 0-{positions - 1} only (stock generate raises "
        f"IndexError there too). A prompt of {request.num_prompt_tokens} tokens can take at most "
        f"{max(positions + 1 - request.num_prompt_tokens, 0)} new tokens unless it stops earlier"
    )


def finish_past_table(
    scheduler: Scheduler, advanced: list[Request], beam_rounds: Iterable[BeamRound]
) -> list[RequestOutput]:
    """Finish every request of ``advanced`` (and beam group continuing after ``beam_rounds``) that did not stop and
    whose last token would be forwarded past the table, with an ``IndexError``; a beam search ends whole. Returns
    the outputs of those not in ``advanced`` (the caller reports those in it)."""
    positions, table = scheduler.position_table
    roots = (scheduler.requests.get(beam_round.root_id) for beam_round in beam_rounds)
    outputs = []
    for request in [*advanced, *(root for root in roots if root is not None)]:
        if request.is_finished or len(request.all_token_ids) <= positions:
            continue
        error = past_table_error(request, positions, table)
        for member in request.members if request.beam_search is not None else [request]:
            if not member.is_finished:
                scheduler.finish(member, error)
        if request not in advanced:  # a beam search's root: its rows are not advanced one by one
            outputs.append(progress_output(request, 0))
    return outputs
