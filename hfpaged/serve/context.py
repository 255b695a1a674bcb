"""What every endpoint needs: the engine client, the tokenizer, the served model's name and its limits."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .engine_client import EngineClient
from .errors import model_not_found
from .logprobs import TokenStrings
from .request_params import ModelLimits

T = TypeVar("T")


@dataclass
class ServingContext:
    """Shared, read-only state of one server's front end (the engine client aside)."""

    engine: EngineClient
    tokenizer: Any
    model_name: str
    limits: ModelLimits
    token_strings: TokenStrings
    created: int  # when the server started (unix time), for /v1/models
    # tokenization and chat templates run here, one at a time, off the event loop: a huge prompt would otherwise
    # stall every stream of this front end until it is tokenized (and found too long)
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfpaged-tokenizer")
    )

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, *args)

    def current_limits(self) -> ModelLimits:
        """``limits`` with the KV pool as the engine reports it now (a re-patch while serving may resize it)."""
        stats = self.engine.stats
        if "num_blocks" in stats and "block_size" in stats:
            pool = int(stats["num_blocks"]) * int(stats["block_size"])
            if pool != self.limits.max_pool_tokens:
                return dataclasses.replace(self.limits, max_pool_tokens=pool)
        return self.limits

    def check_model(self, requested: str | None) -> None:
        """404 unless ``requested`` is this server's model (or absent)."""
        if requested is not None and requested != self.model_name:
            raise model_not_found(requested, self.model_name)
