"""Stop conditions beyond eos and max_length: stop strings, max_time, and user ``stopping_criteria``.

Built per request the way ``generate`` builds them (``_get_stopping_criteria`` merge rules: a criterion you
pass replaces the built-in one of the same type), and checked after every appended token. Stop strings are
checked for all requests that share a criterion in one batched call on the last tokens; ``max_time`` is
measured from the request's arrival; other criteria get the request's full ids, exactly as in ``generate``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from ..model import hf_compat

if TYPE_CHECKING:
    from ..core.request import Request


@dataclass
class StopRules:
    """One request's stop conditions besides eos / max_length (checked by the scheduler itself)."""

    max_length: int = 0  # prompt + generated tokens at most (generate's MaxLengthCriteria, or the user's)
    eos_token_ids: frozenset[int] = frozenset()  # generate's EosTokenCriteria, or the user's that replaced it
    stop_strings: StopStringCriteria | None = None
    max_time: MaxTimeCriteria | None = None
    criteria: StoppingCriteriaList | None = None  # everything else: called with the full ids
    all_criteria: StoppingCriteriaList | None = None  # generate's whole list, eos and max_length included (beams)

    @property
    def is_empty(self) -> bool:
        return self.stop_strings is None and self.max_time is None and self.criteria is None


class StopStringCache:
    """``StopStringCriteria`` shared by requests with the same tokenizer and stop strings: their tables take ~ms
    to build, and requests sharing one are checked in one batched call. An entry holds a weak reference to its
    tokenizer and its vocabulary size, so a tokenizer built at a freed one's address, or one given new tokens,
    gets tables of its own; the least recently used of more than ``max_entries`` is dropped."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()  # any thread may build tables (``PromptMaker.warm_stop_strings``)

    def get(self, tokenizer: Any, stop_strings: str | list[str]) -> StopStringCriteria:
        stops = tuple([stop_strings] if isinstance(stop_strings, str) else stop_strings)
        try:
            key, ref = (id(tokenizer), len(tokenizer), stops), weakref.ref(tokenizer)
        except TypeError:  # no size or no weak reference: tables of its own each time
            return StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is tokenizer:
                self._entries.move_to_end(key)
                return entry[1]
        criterion = StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer)  # (outside the lock: slow)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is tokenizer:  # another thread built them meanwhile: one object
                return entry[1]
            self._entries[key] = (ref, criterion)
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return criterion


def build_stop_rules(
    model: Any,
    config: GenerationConfig,
    user_criteria: StoppingCriteriaList | None,
    tokenizer: Any,
    stop_string_cache: StopStringCache,
) -> StopRules:
    """``generate``'s stopping criteria for one request; StopStringCriteria are shared through the cache."""
    defaults = StoppingCriteriaList()
    if config.max_length is not None:
        defaults.append(MaxLengthCriteria(max_length=config.max_length))
    if config.max_time is not None:
        defaults.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            raise ValueError(
                "There are one or more stop strings, either in the arguments to generate_many or in the model's "
                "generation config, but no tokenizer is known: pass tokenizer= to generate_many or patch."
            )
        defaults.append(stop_string_cache.get(tokenizer, config.stop_strings))
    eos = hf_compat.eos_token_tensor(config)
    if eos is not None:
        defaults.append(EosTokenCriteria(eos_token_id=eos))
    merged = hf_compat.merge_stopping_criteria(model, defaults, user_criteria if user_criteria is not None else [])
    rules = StopRules()
    others = StoppingCriteriaList()
    lengths, eos_ids = [], set()
    for criterion in merged:
        # the scheduler checks max_length and eos itself: generate's criteria, or the user's that replaced them
        if type(criterion) is MaxLengthCriteria:
            lengths.append(criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos_ids.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
        elif type(criterion) is StopStringCriteria and rules.stop_strings is None:
            rules.stop_strings = criterion
        elif type(criterion) is MaxTimeCriteria and rules.max_time is None:
            rules.max_time = criterion
        else:
            others.append(criterion)
    rules.max_length = min(lengths) if lengths else config.max_length
    rules.eos_token_ids = frozenset(eos_ids)
    rules.criteria = others if len(others) else None
    rules.all_criteria = merged
    return rules


def check_stops(requests: list[Request], interrupts: list[BaseException]) -> list[str | BaseException | None]:
    """Why each request (which just gained a token) stops: "stop", "length", "time", or None to go on; or what
    its own stopping criterion raised (an ``Exception`` fails the request, not the step). A criterion raising
    another ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) goes into ``interrupts``, for the step to
    raise once its outputs are delivered; that request's other checks run as if the criterion had not stopped it."""
    reasons: list[str | BaseException | None] = [None] * len(requests)
    by_criterion: dict[int, tuple[StopStringCriteria, list[int]]] = {}
    now = None
    for i, request in enumerate(requests):
        params = request.params
        rules = params.stop
        # the user's criteria run at every token, eos included, and what they raise wins over any stop (generate's
        # StoppingCriteriaList calls each criterion at every step and raises its error)
        if rules.criteria is not None:
            ids = torch.tensor([request.all_token_ids], dtype=torch.long)
            try:
                hit = bool(rules.criteria(ids, None).any())
            except Exception as error:
                reasons[i] = error
                continue
            except BaseException as error:  # noqa: B036 (raised again by the step, after its outputs)
                interrupts.append(error)
                hit = False
            if hit:
                reasons[i] = "stop"
                continue
        if request.all_token_ids[-1] in params.eos_token_ids:
            reasons[i] = "stop"
            continue
        if rules.stop_strings is not None:
            by_criterion.setdefault(id(rules.stop_strings), (rules.stop_strings, []))[1].append(i)
        if len(request.all_token_ids) >= params.max_length:
            reasons[i] = "length"
        elif rules.max_time is not None:
            now = time.time() if now is None else now
            if now - rules.max_time.initial_timestamp > rules.max_time.max_time:
                reasons[i] = "time"
    for criterion, rows in by_criterion.values():
        for i, stopped in zip(rows, _stop_string_hits(criterion, [requests[i] for i in rows])):
            if stopped:
                reasons[i] = "stop"
    return reasons


def _stop_string_hits(criterion: StopStringCriteria, requests: list[Request]) -> list[bool]:
    """The criterion on each request's last ``maximum_token_len`` ids: one call for all long-enough requests."""
    width = criterion.maximum_token_len
    hits = [False] * len(requests)
    full = [i for i, r in enumerate(requests) if len(r.all_token_ids) >= width]
    if full:
        tails = torch.tensor([requests[i].all_token_ids[-width:] for i in full], dtype=torch.long)
        for i, stopped in zip(full, criterion(tails, None).tolist()):
            hits[i] = bool(stopped)
    for i, request in enumerate(requests):
        if len(request.all_token_ids) < width:
            hits[i] = bool(criterion(torch.tensor([request.all_token_ids], dtype=torch.long), None)[0])
    return hits
