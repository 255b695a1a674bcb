"""Resolved generation configs kept across ``Engine.add_request`` calls (``ResolvedConfigCache``), for requests that
repeat their settings: what a server adding requests one at a time would otherwise pay per request."""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from typing import Any

from transformers import GenerationConfig

from .params import ResolvedConfig, _check_supported, resolve_generation_config

# Settings servers vary per request: applied to a request's copy of a cached config (see ResolvedConfigCache)
_PER_REQUEST_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ResolvedConfigCache:
    """Resolved configs kept across ``Engine.add_request`` calls, for requests that repeat their settings.

    ``resolve_generation_config`` costs ~0.3-0.5 ms a request (transformers' ``_prepare_generation_config``
    deep-copies and merges configs): a server adding requests one at a time would pay it on every request. An
    entry is keyed by the caller's ``generation_config`` object and its settings, and used only while
    ``model.generation_config``, ``model.config`` and the caller's config still equal (by value, so in-place
    edits count) deep copies taken when the entry was made; anything else resolves afresh.

    Without a ``generation_config``, the numbers servers vary per request (``_PER_REQUEST_SETTINGS``) are not
    part of the key: they go onto the request's copy of the merged config through ``GenerationConfig.update``,
    the call ``_prepare_generation_config`` applies settings with last (so they win over the model's defaults
    the same way, and are validated the same way).
    """

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self.hits = self.misses = 0

    def resolve(
        self, model: Any, generation_config: GenerationConfig | None, gen_kwargs: dict[str, Any]
    ) -> ResolvedConfig:
        per_request = {}
        if generation_config is None:
            per_request = {
                k: v
                for k, v in gen_kwargs.items()
                if k in _PER_REQUEST_SETTINGS and (v is None or type(v) in (int, float))
            }
        base_kwargs = {k: v for k, v in gen_kwargs.items() if k not in per_request}
        try:
            key = (id(generation_config), _freeze(base_kwargs))
        except TypeError:  # settings that are not plain values (processors, tensors): resolved each time
            self.misses += 1
            return resolve_generation_config(model, generation_config, gen_kwargs)
        entry = self._entries.get(key)
        resolved = None
        if entry is not None:
            config_ref, snapshot, cached = entry
            if (config_ref is None or config_ref() is generation_config) and _same_state(
                snapshot, model, generation_config
            ):
                resolved = cached
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                del self._entries[key]
        if resolved is None:
            self.misses += 1
            snapshot = _snapshot(model, generation_config)  # before resolving: what the entry is made from
            # the entry keeps copies of list/dict settings (stop strings, eos ids): the caller's may change later
            resolved = resolve_generation_config(model, generation_config, copy.deepcopy(base_kwargs))
            if snapshot is not None:
                config_ref = None if generation_config is None else weakref.ref(generation_config)
                self._entries[key] = (config_ref, snapshot, resolved)
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        if per_request:
            config = copy.copy(resolved.generation_config)  # the cached config stays as it was made
            config.update(**per_request)  # validates (max_new_tokens <= 0 raises) as _prepare_generation_config does
            _check_supported(config)
            resolved = ResolvedConfig(config, resolved.has_default_max_length, resolved.has_default_min_length)
        return resolved


def _freeze(value: Any) -> Any:
    """A hashable stand-in for settings made of plain values in lists, tuples, dicts and sets; TypeError for
    anything else (a tensor hashes by identity, so an in-place edit would keep its key). Types are part of it:
    [1] and (1,) stay apart, and so do 1, 1.0 and True, which generate tells apart (``early_stopping is True``)."""
    if isinstance(value, dict):
        return (dict, tuple(sorted((_freeze(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_freeze(v) for v in value))
    if value is None or type(value) in (bool, int, float, str):
        return (type(value), value)
    raise TypeError(f"not a plain value: {type(value).__name__}")


def _snapshot(model: Any, generation_config: GenerationConfig | None) -> tuple | None:
    try:
        return copy.deepcopy(
            (
                model.generation_config.__dict__,
                None if generation_config is None else generation_config.__dict__,
                model.config.__dict__,
            )
        )
    except Exception:  # something that does not copy: never cached
        return None


def _same_state(snapshot: tuple, model: Any, generation_config: GenerationConfig | None) -> bool:
    model_gc, user_gc, model_config = snapshot
    try:
        return (
            _same(model_gc, model.generation_config.__dict__)
            and (user_gc is None or _same(user_gc, generation_config.__dict__))
            and _same(model_config, model.config.__dict__)
        )
    except Exception:  # a value whose comparison is not a bool (a tensor): not the same
        return False


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types throughout (an edit of ``early_stopping`` from 1 to True is a change). A value
    that is the snapshot's own object is the same (deepcopy shares only what it cannot copy: immutable values, or
    objects whose ``__deepcopy__`` returns them, which compare equal to themselves): no walk over it."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(v is b[k] or _same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(x is y or _same(x, y) for x, y in zip(a, b))
    return bool(a == b)
