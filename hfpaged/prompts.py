"""From a caller's prompts and settings to validated ``Request``s (nothing is queued here).

A prompt is a string, token ids (a list, or a 1-D integer tensor or numpy array), or a dict
``{"prompt": ..., "generation_config": GenerationConfig, **settings}``; a 2-D integer tensor or array is a
batch of prompts, one per row (padding needs ``attention_mask=``, as in ``generate``).
``generation_config=`` may also be a list with one config (or None) per prompt. A prompt's config replaces
the call's; its settings are merged key by key over the call's keyword arguments, which in turn override
fields of the config (as in ``generate``). So to vary a setting per prompt, give it in the prompt dicts, not
in the call. Settings that are not GenerationConfig fields are ``CallOptions``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Container
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .core.block_pool import cdiv
from .core.request import Request, RequestGroup
from .model import hf_compat
from .prompt_forms import UnpaddedIds, check_pad_tokens, naming_prompt, to_token_ids
from .sampling.beam_search import BeamSearch
from .sampling.config_cache import ResolvedConfigCache
from .sampling.params import (
    CallOptions,
    ResolvedConfig,
    is_int,
    make_request_params,
    prompt_name,
    resolve_generation_config,
)
from .sampling.stopping import StopStringCache

if TYPE_CHECKING:
    from .model.attach import PatchState

# ``generate`` arguments (not GenerationConfig fields) hfpaged does not implement.
_UNSUPPORTED_ARGUMENTS = {
    "assistant_model": "assisted (speculative) decoding",
    "assistant_tokenizer": "assisted (speculative) decoding",
    "negative_prompt_ids": "classifier-free guidance",
    "negative_prompt_attention_mask": "classifier-free guidance",
    "custom_generate": "custom decoding loops",
    "synced_gpus": "synced multi-GPU generation",
    "attention_mask": "it marks padding of a 2-D batch of prompt rows; give prompts unpadded otherwise",
    "inputs_embeds": "prompts must be token ids or strings",
    "past_key_values": "the paged KV cache is managed by hfpaged",
    "cache": "the paged KV cache is managed by hfpaged",  # transformers 5.24's name for past_key_values
    "input_ids": "pass the prompts as the first argument",
    "inputs": "pass the prompts as the first argument",
}

CALL_OPTION_NAMES = frozenset(f.name for f in fields(CallOptions))


def split_call_options(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(generate kwargs, CallOptions kwargs)``; raises for ``generate`` arguments hfpaged does not support."""
    for name, what in _UNSUPPORTED_ARGUMENTS.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            raise ValueError(f"generate_many does not support {name}= ({what})")
    generate_kwargs = {
        k: v for k, v in kwargs.items() if k not in CALL_OPTION_NAMES and k not in _UNSUPPORTED_ARGUMENTS
    }
    options = {k: v for k, v in kwargs.items() if k in CALL_OPTION_NAMES}
    return generate_kwargs, options


# --- the prompt list ---------------------------------------------------------------------------------


def check_tokenizer(tokenizer: Any) -> None:
    """TypeError unless ``tokenizer`` is None or has ``decode`` (results and streams are decoded with it)."""
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be a transformers tokenizer (with decode()), got {type(tokenizer).__name__}")


@dataclass
class PromptSpec:
    """One prompt with the settings that apply to it."""

    prompt: Any
    generation_config: GenerationConfig | None
    generate_kwargs: dict[str, Any]
    options: CallOptions
    has_own_settings: bool = False  # its generate kwargs differ from the call's


def expand_prompts(
    prompts: list[Any],
    generation_config: GenerationConfig | list[GenerationConfig | None] | None,
    kwargs: dict[str, Any],
) -> list[PromptSpec]:
    """Pair every prompt with its config, generate kwargs and options (see the module docstring)."""
    if isinstance(generation_config, (list, tuple)):
        if len(generation_config) != len(prompts):
            raise ValueError(
                f"generation_config is a list of {len(generation_config)} configs for {len(prompts)} prompts"
            )
        configs = list(generation_config)
    else:
        configs = [generation_config] * len(prompts)
    call_kwargs, call_options = split_call_options(kwargs)
    base_seed = call_options.get("seed")
    if base_seed is not None and not is_int(base_seed):
        raise ValueError(f"seed must be an int, got {base_seed!r}")
    specs = []
    for index, (prompt, config) in enumerate(zip(prompts, configs)):
        own_kwargs: dict[str, Any] = {}
        own_options: dict[str, Any] = {}
        if isinstance(prompt, dict):
            entry = dict(prompt)
            if "prompt" not in entry:
                raise ValueError(f"{prompt_name(index)} is a dict without a 'prompt' key")
            prompt = entry.pop("prompt")
            config = entry.pop("generation_config", config)
            own_kwargs, own_options = split_call_options(entry)
        options = {**call_options, **own_options}
        if "seed" not in own_options and base_seed is not None:
            options["seed"] = (base_seed + index) % 2**62
        with naming_prompt(index, bool(own_options)):
            call_options_of_prompt = CallOptions(**options)
        specs.append(
            PromptSpec(
                prompt=prompt,
                generation_config=config,
                generate_kwargs={**call_kwargs, **own_kwargs},
                options=call_options_of_prompt,
                has_own_settings=bool(own_kwargs),
            )
        )
    return specs


# --- requests ------------------------------------------------------------------------------------------


class PromptMaker:
    """Tokenizes, resolves and validates prompts into requests for one patched model."""

    def __init__(self, model: PreTrainedModel, state: PatchState):
        self._model = weakref.ref(model)
        self.state = weakref.proxy(state)  # the state owns this (through the engine): no reference cycle
        self.stop_string_cache = StopStringCache()  # StopStringCriteria shared by requests with the same stop strings
        self.resolved_configs = ResolvedConfigCache()  # Engine.add_request's merged configs, across calls
        self._ids = itertools.count()
        self.in_use: Callable[[str], bool] = lambda request_id: False  # the engine's running ids (EngineCore)

    def new_id(self, reserved: Container[str] = ()) -> str:
        """A request id nobody uses: ``req-N``, skipping ids a caller chose (running, or ``reserved``)."""
        while True:
            request_id = f"req-{next(self._ids)}"
            if request_id not in reserved and not self.in_use(request_id):
                return request_id

    @property
    def model(self) -> PreTrainedModel:
        return self._model()

    def make_many(
        self,
        prompts: list[Any],
        generation_config: GenerationConfig | list[GenerationConfig | None] | None,
        kwargs: dict[str, Any],
        tokenizer: Any,
    ) -> list[Request]:
        """One request per prompt with its own settings."""
        specs = expand_prompts(prompts, generation_config, kwargs)
        resolved_by_config: dict[int, ResolvedConfig] = {}
        requests, longest = [], {}
        own = [isinstance(p, dict) or isinstance(generation_config, (list, tuple)) for p in prompts]
        for index, spec in enumerate(specs):
            with naming_prompt(index, own[index]):
                request, key, resolved = self._make_spec(spec, index, resolved_by_config, tokenizer)
            requests.append(request)
            if key not in longest or request.num_prompt_tokens > longest[key][0].num_prompt_tokens:
                longest[key] = (request, resolved)
        # generate's length warnings (e.g. min_new_tokens beyond max_length) once per call and setting, as
        # generate gives them once per call: for the longest prompt, the one they concern most
        for request, resolved in longest.values():
            _warn_about_lengths(self.model, request, resolved)
        return requests

    def _make_spec(self, spec: PromptSpec, index: int, resolved_by_config: dict, tokenizer: Any) -> tuple:
        """(request, key of its merged config, the merged config) of one prompt of a call."""
        if spec.has_own_settings:  # through the cache: prompts often differ only in a number (max_new_tokens)
            resolved = self.resolved_configs.resolve(self.model, spec.generation_config, dict(spec.generate_kwargs))
            key: Any = ("own", index)
        else:  # resolve once per distinct config among prompts that only use the call's arguments
            key = id(spec.generation_config)
            if key not in resolved_by_config:
                resolved_by_config[key] = resolve_generation_config(
                    self.model, spec.generation_config, dict(spec.generate_kwargs)
                )
            resolved = resolved_by_config[key]
        return self.make(spec.prompt, resolved, spec.options, tokenizer, index=index), key, resolved

    def make_one(
        self,
        prompt: Any,
        generation_config: GenerationConfig | None,
        kwargs: dict[str, Any],
        tokenizer: Any,
        request_id: str | None,
        index: int | None = None,
    ) -> Request:
        """The request of one prompt of an ``Engine.add_requests`` call (its errors name ``index``, its place in the
        call, where given). Prompts with the same settings share one merged config (as the prompts of a
        ``generate_many`` call do), across calls too while the configs it was merged from are unchanged
        (``ResolvedConfigCache``)."""
        with naming_prompt(index, True):  # (not make's index: it is also the batch_id prefix_allowed_tokens_fn sees)
            if "generation_config" in kwargs:  # a settings dict's own config, as a generate_many prompt dict's
                generation_config = kwargs["generation_config"]
                kwargs = {key: value for key, value in kwargs.items() if key != "generation_config"}
            generate_kwargs, options = split_call_options(kwargs)
            resolved = self.resolved_configs.resolve(self.model, generation_config, generate_kwargs)
            request = self.make(prompt, resolved, CallOptions(**options), tokenizer, index=None, request_id=request_id)
        _warn_about_lengths(self.model, request, resolved)
        return request

    def warm_stop_strings(self, settings: list[Any], generation_config: Any, tokenizer: Any) -> None:
        """Build the stop-string tables that ``Engine.add_requests``' ``settings`` will use into the shared cache,
        before the engine's lock is taken (the server: off its engine thread). Over a large vocabulary long strings
        take seconds, and every other request would wait. Errors are left for ``make_one`` to raise, named."""
        if tokenizer is None:
            with contextlib.suppress(ReferenceError):  # (a stale handle's: make_one's checks say so, clearly)
                tokenizer = self.state.tokenizer  # (as make's)
        for kwargs in settings:
            with contextlib.suppress(Exception):
                if "stop_strings" in kwargs:  # (None: no stops)
                    stops = kwargs["stop_strings"]
                else:  # the given config's, else the model's (merged in as generate merges them)
                    stops = getattr(kwargs.get("generation_config", generation_config), "stop_strings", None)
                    stops = stops if stops is not None else getattr(self.model.generation_config, "stop_strings", None)
                if stops and tokenizer is not None:
                    self.stop_string_cache.get(tokenizer, stops)

    def make(
        self,
        prompt: Any,
        resolved: ResolvedConfig,
        options: CallOptions,
        tokenizer: Any,
        *,
        index: int | None,
        request_id: str | None = None,
    ) -> Request:
        """Tokenize, resolve and validate one prompt."""
        state = self.state
        tokenizer = tokenizer if tokenizer is not None else state.tokenizer
        token_ids = to_token_ids(prompt, index, tokenizer)
        self._validate_tokens(token_ids, index)
        if not isinstance(prompt, UnpaddedIds):
            check_pad_tokens(token_ids, resolved.generation_config, index)
        params = make_request_params(
            self.model,
            resolved,
            token_ids,
            options,
            seed=options.seed if options.seed is not None else 0,
            index=index,
            vocab_size=state.vocab_size,
            tokenizer=tokenizer,
            stop_string_cache=self.stop_string_cache,
            device=state.input_device,
        )
        if options.seed is None and params.do_sample:  # greedy and beams leave torch's RNG alone, as generate does
            # tensor parallel: every rank draws the same seed
            params.seed = state.tp.draw_seed() if state.tp is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._validate_size(params.max_length, index, params.num_beams)
        long_rope, config = state.long_rope, params.generation_config
        if long_rope is not None and (why := long_rope.refusal(len(token_ids), params.max_length, config)):
            raise ValueError(
                f"{prompt_name(index)} has {len(token_ids)} tokens and may grow to {params.max_length}: {why}"
            )
        num_sequences = max(params.num_beams, params.num_return_sequences)
        if num_sequences > state.config.max_num_seqs:
            raise ValueError(
                f"{prompt_name(index)} runs {num_sequences} sequences at once (num_beams / num_return_sequences) but "
                f"max_num_seqs is {state.config.max_num_seqs}"
            )
        request = Request(request_id if request_id is not None else self.new_id(), token_ids, params, index=index)
        if long_rope is not None:
            request.cache_salt, request.restart_past = long_rope.request_settings(len(token_ids), config)
        if params.num_beams > 1:
            RequestGroup(
                request,
                params.num_beams,
                BeamSearch(self.model, request.request_id, params, token_ids, state.input_device),
            )
        elif params.num_return_sequences > 1:
            RequestGroup(request, params.num_return_sequences)
        return request

    def _validate_tokens(self, token_ids: list[int], index: int | None) -> None:
        state = self.state
        if not token_ids:
            raise ValueError(f"{prompt_name(index)} is empty")
        bad = next((t for t in token_ids if t < 0 or t >= state.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{prompt_name(index)} has token id {bad} outside the vocabulary [0, {state.vocab_size})")
        # a learned position table has no row past its positions (stock raises IndexError in the forward); RoPE
        # models serve longer prompts, as stock does (limits of dynamic RoPE / longrope / windows: _validate_size)
        table = state.position_table
        if table is not None and len(token_ids) > table[0]:
            raise ValueError(
                f"{prompt_name(index)} has {len(token_ids)} tokens, more than the model's maximum of "
                f"{table[0]} positions (its learned position table, {table[1]})"
            )

    def _validate_size(self, max_length: int, index: int | None, num_beams: int) -> None:
        """Raise ValueError (naming the prompt and the numbers) for a request that can never fit the pool."""
        block_size, num_blocks = self.state.config.block_size, self.state.num_blocks
        # the last generated token is never forwarded: a request's forwards see max_length - 1 positions
        if self.state.length_limit is not None and max_length - 1 > self.state.length_limit[0]:
            limit, why = self.state.length_limit
            raise ValueError(
                f"{prompt_name(index)} may grow to {max_length} tokens ({max_length - 1} forwarded), past the {limit} "
                f"positions {why}; lower max_new_tokens"
            )
        # The last generated token never enters the cache: a request holds at most max_length - 1 slots.
        max_slots = max_length - 1
        blocks = cdiv(max_slots, block_size)
        if blocks > num_blocks:
            raise ValueError(
                f"{prompt_name(index)} needs up to {max_slots} KV slots ({blocks} blocks of {block_size}) "
                f"but the pool holds only {num_blocks} blocks; raise num_blocks or lower max_new_tokens"
            )
        # the beams of a group run (and, after a preemption, are recomputed) together: all must fit at once
        if num_beams > 1 and num_beams * blocks > num_blocks:
            raise ValueError(
                f"{prompt_name(index)} with num_beams={num_beams} needs up to {num_beams} x {blocks} blocks of "
                f"{block_size} slots but the pool holds only {num_blocks} blocks; raise num_blocks or lower max_new_tokens"
            )


def _warn_about_lengths(model: PreTrainedModel, request: Request, resolved: ResolvedConfig) -> None:
    hf_compat.validate_generated_length(
        model, request.params.generation_config, request.num_prompt_tokens, resolved.has_default_max_length
    )


def check_batch(prompts: Any, settings: Any, request_ids: Any) -> None:
    """``Engine.add_requests``'s arguments: lists of prompts and of settings dicts, and of request ids or None, one
    per prompt (a ``TypeError`` or ``ValueError`` naming what is wrong)."""
    for name, value in (("prompts", prompts), ("settings", settings), ("request_ids", request_ids)):
        if (value is not None or name != "request_ids") and not isinstance(value, (list, tuple)):
            raise TypeError(f"add_requests: {name} must be a list, got {type(value).__name__}")
    bad = next((i for i, kwargs in enumerate(settings) if not isinstance(kwargs, dict)), None)
    if bad is not None:
        raise TypeError(f"add_requests: settings[{bad}] must be a dict of settings, got {type(settings[bad]).__name__}")
    if any(kwargs.get("streamer") is not None for kwargs in settings):
        raise ValueError("streamer= is for generate_many with one prompt; read Engine.step() outputs instead")
    if len(settings) != len(prompts) or (request_ids is not None and len(request_ids) != len(prompts)):
        raise ValueError(
            f"add_requests needs one settings dict (and request id) per prompt: {len(prompts)} prompts, "
            f"{len(settings)} settings" + ("" if request_ids is None else f", {len(request_ids)} request ids")
        )


def check_request_id(request_id: Any, in_use: Callable[[str], bool]) -> None:
    """ValueError for an ``Engine`` request id that is not a string without '.', or is ``in_use``; None passes."""
    if request_id is None:
        return
    if not isinstance(request_id, str) or "." in request_id:
        raise ValueError(
            f"request_id must be a string without '.', got {request_id!r} (hfpaged names the parallel samples and "
            "beams of a prompt '<request_id>.<n>')"
        )
    if in_use(request_id):
        raise ValueError(f"request_id {request_id!r} is already in use")
