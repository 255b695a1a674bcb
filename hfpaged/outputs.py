"""What generate_many and Engine.step hand back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core.request import Request


@dataclass(slots=True)
class RequestOutput:
    """What one request gained in one engine step."""

    request_id: str
    index: int | None  # position in the generate_many prompt list, when there is one
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "time", "abort", "error" or None while running
    new_logprobs: list[float] | None = None  # log-probs of new_token_ids when return_logprobs is on
    new_top_logprobs: list[dict[int, float]] | None = None  # with top_logprobs=k: the top k per new token
    # The request's prompt + output ids (append-only, shared, not copied each step) and where they end now.
    all_token_ids: list[int] = field(default_factory=list, repr=False)
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    sequence_index: int = 0  # which of its prompt's returned sequences (num_return_sequences > 1)
    error: str | None = None  # with finish_reason "error": what went wrong
    prompt_id: str = ""  # the id add_request returned for its prompt (request_id of sequence 0)

    @property
    def token_ids(self) -> list[int]:
        """Every token generated up to this step."""
        return self.all_token_ids[self.num_prompt_tokens : self.num_tokens]


def progress_output(request: Request, num_new: int = 1) -> RequestOutput:
    """What ``request`` gained: its last ``num_new`` tokens (a step's usual output: one; a failed pick: none)."""
    ids = request.all_token_ids
    logprobs, top = request.logprobs, request.top_logprobs
    return RequestOutput(
        request.request_id,
        request.index,
        ids[len(ids) - num_new :],
        request.is_finished,
        request.finish_reason,
        None if logprobs is None else logprobs[len(logprobs) - num_new :],
        None if top is None else top[len(top) - num_new :],
        ids,
        request.num_prompt_tokens,
        len(ids),
        request.sequence_index,
        request.error,
        request.prompt_id,
    )


def final_output(request: Request) -> RequestOutput:
    """A finished request's one output when its steps were not streamed: every token it generated."""
    return progress_output(request, len(request.all_token_ids) - request.num_prompt_tokens)


def step_outputs(advanced: list[Request]) -> list[RequestOutput]:
    """A step's outputs for the requests that gained a token: each streamed one's token, each finished one whole."""
    return [
        progress_output(request) if request.stream_outputs else final_output(request)
        for request in advanced
        if request.stream_outputs or request.is_finished
    ]


def sequence_output(root: Request, token_ids: list[int], *, finish_reason: str, sequence_index: int) -> RequestOutput:
    """One returned sequence of a finished beam search: ``token_ids`` generated after ``root``'s prompt."""
    all_token_ids = root.prompt_token_ids + token_ids
    return RequestOutput(
        root.request_id,
        root.index,
        list(token_ids),
        True,
        finish_reason,
        None,
        None,
        all_token_ids,
        len(root.prompt_token_ids),
        len(all_token_ids),
        sequence_index,
        root.error,
        root.prompt_id,
    )


@dataclass
class SequenceOutput:
    """One of the sequences returned for a prompt (``num_return_sequences`` of them, best beam first)."""

    token_ids: list[int]  # generated ids only, including the eos that stopped it
    text: str | None
    finish_reason: str
    score: float | None = None  # beam search: generate's ``sequences_scores`` (length-penalized log-probability)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationResult:
    """The outcome of one prompt, in the order the prompts were given."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only, including the eos that stopped it (as generate returns)
    text: str | None  # decoded generated text when a tokenizer is known
    finish_reason: str  # "stop" (eos, stop string, stopping criteria), "length", "time" (max_time) or "abort"
    metrics: dict[str, float] = field(default_factory=dict)  # time_to_first_token, latency (s), tokens_per_second
    # With return_logprobs: the log-probability of each generated token under the processed distribution
    # (what compute_transition_scores(..., normalize_logits=True) gives); with top_logprobs=k also the k
    # most likely tokens per position, {token id: log-prob}, most likely first (impossible ones left out).
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    # Every returned sequence (one unless num_return_sequences > 1); token_ids, text, finish_reason and
    # logprobs above are those of the first. Beam search: best first, in generate's order, with scores.
    sequences: list[SequenceOutput] = field(default_factory=list)
