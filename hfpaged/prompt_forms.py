"""The forms a prompt may take (strings, token-id lists, 1-D and 2-D tensors or arrays, masks) and what ``generate``
makes of them: a 2-D batch's attention mask, the pad token it would mask by itself, and errors that name the prompt."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig

from .sampling.params import prompt_name


@contextmanager
def naming_prompt(index: int | None, own_settings: bool) -> Iterator[None]:
    """A ``ValueError``/``TypeError`` raised by a prompt's own settings (a dict prompt, a list of configs) names the
    prompt; errors in the call's settings (the same for every prompt) name only the argument."""
    try:
        yield
    except (ValueError, TypeError) as error:
        if not own_settings or index is None or str(error).startswith(prompt_name(index)):
            raise
        text, unnamed = str(error), prompt_name(None)
        if text.startswith(unnamed) and text[len(unnamed) : len(unnamed) + 1] in (" ", ":"):  # made without its index
            text = prompt_name(index) + text[len(unnamed) :]  # "the prompt has ..." -> "prompt 3 has ..."
        else:
            text = f"{prompt_name(index)}: {text}"
        try:
            named = type(error)(text)
        except Exception:  # an exception class that takes other arguments: as it is, its cause kept
            named = None
        if named is None:
            raise
        raise named from error


class UnpaddedIds(list):
    """A prompt's token ids whose padding an ``attention_mask`` already removed: ``generate`` infers no padding from
    the pad token when a mask is given, so neither does ``check_pad_tokens``."""


def check_pad_tokens(token_ids: list[int], config: GenerationConfig, index: int | None) -> None:
    """ValueError where ``generate`` would mask positions of this prompt out by itself: without an attention mask it
    masks every position holding ``pad_token_id`` when that is set and is not an eos token id (transformers'
    ``_prepare_attention_mask_for_generation``); generate_many would read them as prompt tokens."""
    pads = set(_id_list(config.pad_token_id))
    if pads.isdisjoint(token_ids) or not pads.isdisjoint(_id_list(config.eos_token_id)):
        return  # stock masks nothing where a pad id is also an eos id
    positions = [i for i, t in enumerate(token_ids) if t in pads]
    pad = config.pad_token_id if len(pads) > 1 else next(iter(pads))
    raise ValueError(
        f"{prompt_name(index)} holds the pad token id {pad} at positions {positions[:8]}: generate would mask those "
        "positions out (its pad_token_id is set and is not an eos token id), generate_many would attend to them. "
        "Give the prompt without them, a 2-D batch with attention_mask=, or pad_token_id=None to keep them"
    )


def _id_list(value: Any) -> list[int]:
    """Token ids given as an int, a list or tuple, or a tensor/array of any shape, as a flat list (None: none)."""
    if value is None:
        return []
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _id_list(v)]
    return [int(value)]


def _is_int_array(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() and not value.is_complex() and value.dtype is not torch.bool
    return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.integer)


def prompt_list(prompts: Any, kwargs: dict[str, Any]) -> list[Any]:
    """``prompts`` as a list of single prompts. A 2-D integer tensor/array is a batch of rows: an
    ``attention_mask`` in ``kwargs`` (popped) strips their padding; without one, a row holding the pad token
    is refused as any prompt is (``check_pad_tokens``: generate would mask it out)."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if not _is_int_array(prompts):
            raise TypeError(
                f"prompts is a {type(prompts).__name__} of dtype {prompts.dtype}; token ids must be integers"
            )
        if prompts.ndim == 1:
            raise ValueError(
                "prompts must be a list of prompts (strings, token-id lists or dicts), not a single prompt"
            )
        if prompts.ndim != 2:
            raise ValueError(
                f"prompts is a {prompts.ndim}-D {type(prompts).__name__} of shape {tuple(prompts.shape)}; give a list of "
                "prompts, or a 2-D [batch, length] tensor of token ids (one prompt per row)"
            )
        # numpy rows as Python ints directly (torch refuses negative strides and big-endian arrays)
        rows = prompts.tolist() if isinstance(prompts, np.ndarray) else prompts.cpu().tolist()
        mask = kwargs.pop("attention_mask", None)
        if mask is not None:
            mask = torch.as_tensor(np.asarray(mask).tolist() if isinstance(mask, np.ndarray) else mask).cpu()
            if tuple(mask.shape) != tuple(prompts.shape):
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but prompts has {tuple(prompts.shape)}")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(
                    f"attention_mask must hold 0 (padding) and 1 (token) only, got {mask.unique().tolist()}"
                )
            keeps = mask.tolist()
            if any(0 in keep_row[keep_row.index(1) :] for keep_row in keeps if 1 in keep_row):
                warnings.warn(  # generate would attend over the gaps and give other tokens; here each row is unpadded
                    "attention_mask has padding after tokens (right or inner padding): generate_many drops every "
                    "masked position and generates from each row's remaining tokens; pad on the left to match generate",
                    stacklevel=3,
                )
            return [UnpaddedIds(t for t, keep in zip(row, keep_row) if keep) for row, keep_row in zip(rows, keeps)]
        return rows  # rows holding the pad token: refused per prompt (check_pad_tokens), as lists are
    if isinstance(prompts, Mapping) and "prompt" not in prompts:  # a tokenizer's BatchEncoding (a UserDict), ...
        keys = ", ".join(repr(k) for k in list(prompts)[:4])
        raise TypeError(
            f"prompts is a {type(prompts).__name__} (keys {keys}), not a list of prompts: for a tokenizer's output "
            "(tokenizer(...), apply_chat_template(...)) pass enc['input_ids'] as the prompts, with "
            "attention_mask=enc['attention_mask'] where it holds padding"
        )
    if isinstance(prompts, (str, Mapping)):
        raise ValueError("prompts must be a list of prompts (strings, token-id lists or dicts), not a single prompt")
    if not isinstance(prompts, (list, tuple)) and not hasattr(prompts, "__iter__"):
        raise TypeError(
            "prompts must be a list of prompts (strings, token-id lists or dicts) or a 2-D tensor of token ids, "
            f"got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], bool):
        raise ValueError("prompts must be a list of prompts (strings, token-id lists or dicts), not a single prompt")
    return prompts


def to_token_ids(prompt: Any, index: int | None, tokenizer: Any) -> list[int]:
    """One prompt as a list of token ids (a string goes through the tokenizer)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(
                f"{prompt_name(index)} is a string but no tokenizer is known; pass tokenizer= to generate_many or patch, "
                "or give token-id lists"
            )
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if not _is_int_array(prompt):
            raise TypeError(
                f"{prompt_name(index)} is a {type(prompt).__name__} of dtype {prompt.dtype}; token ids must be integers"
            )
        if prompt.ndim == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.ndim != 1:
            raise ValueError(
                f"{prompt_name(index)} has shape {tuple(prompt.shape)}; a prompt is 1-D token ids (pass a 2-D tensor as the "
                "prompts argument itself for a batch of rows)"
            )
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"{prompt_name(index)} must be a string or a list of int token ids")
        return [int(t) for t in prompt]
    raise TypeError(f"{prompt_name(index)} has unsupported type {type(prompt).__name__}; give a string or token ids")
