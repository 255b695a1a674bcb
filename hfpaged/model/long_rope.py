"""LongRoPE (Phi-3.5-mini, Phi-4-mini, ...) past its short length: frequencies picked per token, as stock picks them.

transformers' ``longrope`` rotary embedding uses its long frequencies for a whole forward when the forward's largest
position is >= ``original_max_position_embeddings`` (L; ``@dynamic_rope_update``). Stock ``generate`` runs one
sequence per forward, so for a request whose prompt has P tokens:
- a prompt with P > L is computed long at every position (its prefill forward reaches P - 1 >= L);
- otherwise tokens are computed short until the sequence reaches position L. There a model like Llama rotates each
  later token long and keeps the short keys it cached; Phi-3 (and PhiMoE, Phi-4-multimodal) instead drop the cache
  in ``prepare_inputs_for_generation`` and recompute the whole sequence long (``hf_compat.longrope_crossing``
  tells them apart). hfpaged does the same: the scheduler recomputes such a request from its first token when it
  grows past L tokens (``Request.restart_past``), as after a preemption, and from then on it is long. On
  transformers 5.17 Phi-3's generate drops the cache there but computes only the last token, with no context:
  hfpaged refuses requests that would reach that forward (``LongRope.refusal``) rather than copy it.
- ``generate(use_cache=False)`` runs every forward over the whole sequence: past L all of it is long, for any
  model; such a request is restarted like a Phi-3 one. ``prefill_chunk_size`` shorter than a prompt longer than L
  is refused (stock rotates the first chunks short).
A request that is long at every position carries ``LONG_ROPE_SALT`` (``Request.cache_salt``): its prefix-cache blocks
are shared only with other such requests. A paged step packs many sequences and chunks of prompts, so the decision
is made per token on the host (``long_positions``: salted, or at a position >= L) and travels in the position
itself: a long token's position carries ``LONG_POSITION`` on top. During paged steps each longrope module has a
forward (``long_rope_step``) that takes the mark off, runs the module's own undecorated forward with the short and
with the long frequencies, and picks per token: the model's own arithmetic, so float32 stays token-exact, and no
host decision inside the step (CUDA graphs replay it as it is). Recompute after a preemption gives every token the
same decision again. A patch-time probe checks that the mark reaches nothing but these modules; a model where it
would, or whose ``generate`` cannot be told apart, keeps the length limit (``hf_compat.rope_length_limit``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers

from ..core.request import LONG_ROPE_SALT
from . import hf_compat

LONG_POSITION = 1 << 30  # added to a long token's position (int32 step inputs; positions stay below it)


@dataclass
class LongRope:
    """The model's longrope rotary modules, the length L past which tokens go long, and what ``generate`` does
    when a sequence grows past L (``hf_compat.longrope_crossing``: "keep", "recompute" or "drop")."""

    original: int
    modules: list[tuple[torch.nn.Module, hf_compat.LongRopeParts]]
    crossing: str = "keep"

    @property
    def short_prompt_limit(self) -> tuple[int, int] | None:
        """(P, N): a prompt of at most P tokens may reach N tokens in all, where ``generate`` drops the cache past
        L and computes only the last token (Phi-3 on transformers 5.17-5.19); None elsewhere."""
        return (self.original, self.original + 1) if self.crossing == "drop" else None

    @property
    def restarts(self) -> bool:
        """A request growing past L is computed again from its first token (``Request.restart_past``)."""
        return self.crossing == "recompute"

    def request_settings(self, num_prompt_tokens: int, generation_config: Any) -> tuple[str | None, int | None]:
        """A new request's (cache salt, restart point): salted iff its prompt is longer than L (long at every
        position); restarted past L tokens where generate recomputes the sequence there (Phi-3 from transformers
        5.20, and any model under ``use_cache=False``, whose every forward computes the whole sequence)."""
        salt = LONG_ROPE_SALT if num_prompt_tokens > self.original else None
        recomputes = self.restarts or getattr(generation_config, "use_cache", True) is False
        return salt, self.original if recomputes else None

    def refusal(self, num_prompt_tokens: int, max_length: int, generation_config: Any) -> str | None:
        """Why a request may not run, or None.

        - Where ``generate`` drops the cache past L and computes only the last token (Phi-3 on transformers
          5.17-5.19), a short prompt's continuation past L has no context in stock output: hfpaged serves what
          stock computes, so such a request (one reaching a forward over L + 1 tokens) is refused.
        - ``prefill_chunk_size`` shorter than a prompt longer than L: stock rotates each chunk by its own length
          (the first chunks short), which hfpaged does not copy.
        """
        chunk = getattr(generation_config, "prefill_chunk_size", None)
        if chunk and num_prompt_tokens > max(chunk, self.original):
            return (
                f"prefill_chunk_size={chunk} with this longrope model: generate rotates each prefill chunk with the "
                f"frequencies of its own length (short below {self.original} positions), which hfpaged does not "
                "copy; leave prefill_chunk_size unset"
            )
        bound = self.short_prompt_limit
        if bound is None or getattr(generation_config, "use_cache", True) is False:
            return None
        if num_prompt_tokens > bound[0] or max_length <= bound[1]:
            return None
        return (
            f"a prompt of at most {self.original} tokens may grow to {self.original + 1} tokens at most with this "
            f"model on transformers {transformers.__version__}: past that, its generate drops the cache and "
            "computes each new token without context (later transformers recompute the sequence; hfpaged does "
            "that there); lower max_new_tokens, or give a prompt longer than "
            f"{self.original} tokens"
        )


def long_positions(positions: np.ndarray, salted: np.ndarray, original: int) -> np.ndarray:
    """``positions`` with ``LONG_POSITION`` added where stock ``generate`` uses the long frequencies: every token of
    a salted request (long at every position), and any token at a position >= L."""
    long = (positions >= original) | salted
    return positions + long.astype(positions.dtype) * LONG_POSITION


_in_step = threading.local()  # .depth: paged steps of this thread under way (long_rope_step)


def _step_forward(module: torch.nn.Module, parts: hf_compat.LongRopeParts, x, position_ids, *args, **kwargs):
    """The rotary forward of a paged step: each token's (cos, sin) from the set its mark names. Another thread's
    call (a stock forward of the decoder, outside the model's forward lock) runs the module's own forward."""
    if not getattr(_in_step, "depth", 0):
        return type(module).forward(module, x, position_ids, *args, **kwargs)
    long = position_ids >= LONG_POSITION
    positions = torch.where(long, position_ids - LONG_POSITION, position_ids)
    short = parts.rotate(module, False, x, positions, *args, **kwargs)
    long_set = parts.rotate(module, True, x, positions, *args, **kwargs)
    pick = long[..., None]
    return tuple(torch.where(pick, long_part, short_part) for short_part, long_part in zip(short, long_set))


@contextmanager
def long_rope_step(long_rope: LongRope | None) -> Iterator[None]:
    """For one paged forward, give each longrope module the per-token forward (an accelerate hook keeps its place:
    the forward it wraps is swapped instead)."""
    if long_rope is None:
        yield
        return
    installed = []
    for module, parts in long_rope.modules:
        name = "_old_forward" if "_hf_hook" in module.__dict__ else "forward"
        installed.append((module, name, module.__dict__.get(name)))
        module.__dict__[name] = functools.partial(_step_forward, module, parts)
    _in_step.depth = getattr(_in_step, "depth", 0) + 1
    try:
        yield
    finally:
        _in_step.depth -= 1
        for module, name, previous in installed:
            if previous is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = previous


def find_long_rope(model: torch.nn.Module, device: torch.device, lock) -> LongRope | None:
    """The model's longrope modules if every one can take marked positions and nothing else reads them; else None
    (no longrope module, one laid out otherwise, a ``generate`` that cannot be told apart, or a probe forward
    whose output the mark changed)."""
    modules = [m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"]
    if not modules:
        return None
    found = []
    for module in modules:
        parts = hf_compat.longrope_parts(module)
        if parts is None or ("forward" in module.__dict__ and "_hf_hook" not in module.__dict__):
            return None
        found.append((module, parts))
    originals = {parts.original for _, parts in found}
    if len(originals) != 1:
        return None
    original = originals.pop()
    crossing = hf_compat.longrope_crossing(model, original)
    if crossing is None:
        return None
    long_rope = LongRope(original, found, crossing)
    # the same short-frequency tokens, marked and not: only the rotary modules may see the difference
    short = LongRope(
        long_rope.original, [(m, hf_compat.LongRopeParts(p.original, p.forward, m.original_inv_freq)) for m, p in found]
    )
    input_ids = torch.tensor([[3, 4, 5]], device=device)
    plain = torch.arange(3, device=device)[None]
    try:
        with torch.inference_mode(), lock, long_rope_step(short):
            unmarked = model(input_ids=input_ids, position_ids=plain, use_cache=False).logits
            marked = model(input_ids=input_ids, position_ids=plain + LONG_POSITION, use_cache=False).logits
    except Exception:
        return None
    return long_rope if torch.equal(unmarked, marked) else None
