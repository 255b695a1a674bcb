"""What is slow to build for a request is built before its command reaches the engine thread, off the caller's
thread too (the single-process server's event loop; a front end's command reader): the stop strings' tables
(transformers' ``StopStringCriteria``: seconds for long strings over a large vocabulary). Every other request would
otherwise wait: built on the engine thread, it stops every running stream; on the event loop, all HTTP traffic.

Commands pass through in arrival order, one drain thread at a time, started when an add arrives and ending when none
is left (so nothing outlives the engine loop it feeds). A command with nothing ahead of it goes straight on, and so
does an abort none of whose requests is in an add still waiting here (an abort never overtakes its request's add,
but a running request is not left generating behind another request's build).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .messages import AbortRequests, AddRequests


class CommandPreparer:
    """``put`` a command: its stop-string tables are built into the model's engine's cache (``warm``), then it is
    handed to ``deliver`` (the engine loop's queue), in the order the commands came."""

    def __init__(self, deliver: Callable[[Any], None], model: Any, tokenizer: Any):
        self._deliver = deliver
        self._model = weakref.ref(model)
        self._tokenizer = tokenizer
        self._items: collections.deque = collections.deque()
        self._current: Any = None  # the command being prepared
        self._lock = threading.Lock()
        self._draining = False

    def put(self, item: tuple[int | None, Any]) -> None:
        """Queue ``(source, command)``; never waits for a build. A command with nothing to build and nothing ahead
        of it goes straight on."""
        with self._lock:
            command = item[1]
            ahead = self._draining
            if ahead and isinstance(command, AbortRequests):
                ahead = not set(command.request_ids).isdisjoint(self._waiting_ids())
            if not ahead and not isinstance(command, AddRequests):
                self._deliver(item)  # (under the lock: no later command can overtake it)
                return
            self._items.append(item)
            if self._draining:
                return
            self._draining = True
        try:
            threading.Thread(target=self._drain, name="hfpaged-prepare", daemon=True).start()
        except Exception:  # no new threads (the interpreter is exiting): in this one
            self._drain()

    def _waiting_ids(self) -> set[str]:
        commands = [command for _, command in self._items] + [self._current]
        return {s.request_id for c in commands if isinstance(c, AddRequests) for s in c.submissions}

    def _drain(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._items:
                        return
                    item = self._items.popleft()
                    self._current = item[1]
                self.warm(item[1])
                with self._lock:
                    self._deliver(item)
                    self._current = None
        finally:  # (whatever happened, a later put starts a drain again)
            with self._lock:
                self._draining = False
                self._current = None

    def warm(self, command: Any) -> None:
        """Build the stop-string tables of an ``AddRequests`` into the model's current engine's cache (errors are the
        engine's to raise, named, when it adds the requests)."""
        if not isinstance(command, AddRequests):
            return
        with contextlib.suppress(Exception):
            core = getattr(getattr(self._model(), "_hfpaged", None), "engine", None)  # (re-patched: the new one)
            if core is not None:
                settings = [submission.generate_kwargs for submission in command.submissions]
                core.prompts.warm_stop_strings(settings, None, self._tokenizer)
