"""The runner's own copy of one request: what sampling reads (settings, known tokens), kept between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .beam_search import BeamSearch
    from .params import RequestParams


class CachedRequestState:
    """One request as the runner knows it: built from ``NewRequestData``, grown by the tokens it samples.

    ``token_ids`` holds every token whose value the host knows; a token sampled by the step still in flight
    is not among them until that step's result is read (the next step reads it on the device).
    """

    def __init__(
        self,
        request_id: str,
        params: RequestParams,
        token_ids: list[int],
        num_prompt_tokens: int,
        *,
        sequence_index: int = 0,
        num_forks: int = 0,
        beam_search: BeamSearch | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.sequence_index = sequence_index
        self.num_forks = num_forks  # parallel sampling: sequences it forks into at its first sample
        self.beam_search = beam_search
        self.cache_salt: str | None = None  # the request's prefix-cache salt (longrope: long at every position)
        self.row = -1  # its row in the runner's block table
        self.is_finished = False  # dropped by the runner (finished, preempted or replaced)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
