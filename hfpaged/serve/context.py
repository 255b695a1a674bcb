"""What every endpoint needs: the engine client, the tokenizer, the served model's name and its limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .engine_client import EngineClient
from .errors import model_not_found
from .logprobs import TokenStrings
from .request_params import ModelLimits


@dataclass
class ServingContext:
    """Shared, read-only state of one server's front end (the engine client aside)."""

    engine: EngineClient
    tokenizer: Any
    model_name: str
    limits: ModelLimits
    token_strings: TokenStrings
    created: int  # when the server started (unix time), for /v1/models

    def check_model(self, requested: str | None) -> None:
        """404 unless ``requested`` is this server's model (or absent)."""
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)
