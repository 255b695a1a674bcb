"""Ctrl-C held back while a step runs: a step stopped half way through its host code (tokens appended but not
stop-checked, a beam round half applied, outputs built but not handed out) cannot always be undone, so a Ctrl-C
waits for the step. Only where the step may wait for long (the model's forward, the device, user logits
processors: ``escapable``) does a second Ctrl-C raise at once; the recovery of a failed step handles that."""

import _signal  # signal.signal is this plus an enum conversion of its result: ~10 us a call, this ~0.3 us
import contextlib
import signal
import threading

_heard = [None]  # the program's own SIGINT handler that last heard a held signal (see _hold)


class interrupts_deferred:
    """Inside the block a Ctrl-C (SIGINT under Python's default handler) is held in ``caught`` as a
    ``KeyboardInterrupt`` for the caller to raise after the block (``release``); inside ``escapable`` parts a second
    one raises at once. Where the program has a SIGINT handler of its own (a Python function: a server's, or one
    that raises ``KeyboardInterrupt`` itself), each SIGINT is held and that handler called by ``release`` (a second
    one inside ``escapable`` parts calls it at once). Only the main thread receives signals: elsewhere nothing
    changes. A handler the block's code installs is left in place."""

    def __init__(self) -> None:
        self.caught: list[KeyboardInterrupt] = []
        self.own_handler = None  # the program's own SIGINT handler, called for each held signal by ``release``
        self.held: list[tuple] = []  # (signum, frame) of each SIGINT held for ``own_handler``
        self.previous = None  # the handler installed before the block (put back after it)
        self.escape = False  # raise at a second Ctrl-C (set by ``escapable``; never inside __enter__ / __exit__)
        self.handler = self._hold  # (one bound method: what __exit__ compares the installed handler with)
        self.installed = False
        self.outer: interrupts_deferred | None = None  # a step's deferral this one runs inside (a nested call)
        self.outer_escape = False

    def __enter__(self) -> "interrupts_deferred":
        if threading.current_thread() is not threading.main_thread():
            return self
        current = _signal.getsignal(signal.SIGINT)
        outer = getattr(current, "__self__", None)
        if isinstance(outer, interrupts_deferred) and current is outer.handler:
            # a call made inside another step (a logits processor or criterion generating with a model): the outer
            # step holds its Ctrl-Cs, and none may escape half way through this step's bookkeeping
            self.outer, self.outer_escape, outer.escape = outer, outer.escape, False
        elif callable(current):  # Python's default handler, or the program's own
            self.previous = current
            self.own_handler = None if current is signal.default_int_handler else current
            self.installed = True
            _signal.signal(signal.SIGINT, self.handler)
        return self

    def __exit__(self, *exc_info) -> None:
        self.escape = False
        if self.outer is not None:
            self.outer.escape, self.outer = self.outer_escape, None
        if self.installed and _signal.getsignal(signal.SIGINT) is self.handler:
            _signal.signal(signal.SIGINT, self.previous)
        self.installed = False
        self.handler = None  # the bound method refers back to this object: a cycle per step for the collector

    def _hold(self, signum, frame) -> None:
        if self.own_handler is not None:
            # a second signal (in this step, or after the handler heard one in an earlier step without stopping the
            # program: asyncio's cancels its task at the first, raises at the second) calls it at once where the
            # step may wait for long; it may raise: the step recovers, as from a second Ctrl-C
            if self.escape and (self.held or self.own_handler is _heard[0]):
                self.own_handler(signum, frame)
            else:
                self.held.append((signum, frame))
            return
        if self.caught and self.escape:
            raise KeyboardInterrupt
        self.caught.append(KeyboardInterrupt())

    def release(self) -> None:
        """After the block: call the program's own handler for each signal held, then raise a held Ctrl-C."""
        held, self.held = self.held, []
        if held:
            _heard[0] = self.own_handler
        for signum, frame in held:
            self.own_handler(signum, frame)
        if self.caught:
            raise self.caught.pop(0)


class escapable:
    """Inside: a second Ctrl-C raises at once (``guard``: the step's deferral, None for none)."""

    def __init__(self, guard: interrupts_deferred | None) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        if self.guard is not None:
            self.guard.escape = True

    def __exit__(self, *exc_info) -> None:
        if self.guard is not None:
            self.guard.escape = False


@contextlib.contextmanager
def signals_held():
    """SIGINTs held until the block is done (an abort: its block accounting must not stop half way), then raised
    (a Ctrl-C) or handed to the program's own handler."""
    deferral = interrupts_deferred()
    with deferral:
        yield
    deferral.release()


def raise_after_step(deferral: interrupts_deferred, failed_box: list, pending: list) -> None:
    """After a step and its delivery: the program's own handler hears of each signal held (``release``); then the
    step's own error (``failed_box``: it, or empty) is raised, unless it is an ``Exception`` and a held signal asked
    to stop (a ``KeyboardInterrupt``, a handler's ``SystemExit``): that is raised, from it; then the first of
    ``pending`` (a criterion's interrupt: the step completed, nothing to recompute); then a held Ctrl-C. Both lists
    are emptied: the caller's frame, in the traceback of what is raised, must not hold it (a cycle per interrupt)."""
    failed = failed_box.pop() if failed_box else None
    first_pending = pending[0] if pending else None
    pending.clear()
    heard = None
    try:
        deferral.release()
    except BaseException as error:
        heard = error
    try:
        if failed is not None:
            if heard is not None and not isinstance(heard, Exception) and isinstance(failed, Exception):
                raise heard from failed
            raise failed
        if first_pending is not None:
            raise first_pending
        if heard is not None:
            raise heard
    finally:  # this frame is in the traceback of what it raises: its locals would make a cycle with it
        heard = failed = first_pending = deferral = None
