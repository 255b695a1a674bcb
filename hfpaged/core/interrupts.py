"""Ctrl-C held back while a step runs: a step stopped half way through its host code (tokens appended but not
stop-checked, outputs built but not handed out) cannot always be undone, so the first Ctrl-C waits for the step."""

import _signal  # signal.signal is this plus an enum conversion of its result: ~10 us a call, this ~0.3 us
import signal
import threading


class interrupts_deferred:
    """Inside the block a Ctrl-C (SIGINT under Python's default handler) goes into ``sink`` as a
    ``KeyboardInterrupt`` for the caller to raise after the block; a second one raises at once (a step that
    hangs can still be stopped). Only the main thread receives signals: elsewhere, or where the program has a
    SIGINT handler of its own (a server's), nothing changes."""

    def __init__(self, sink: list[BaseException]) -> None:
        self.sink, self.held, self.installed = sink, False, False

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        if main and _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _signal.signal(signal.SIGINT, self._hold)
            self.installed = True

    def __exit__(self, *exc_info) -> None:
        if self.installed:
            _signal.signal(signal.SIGINT, signal.default_int_handler)
            self.installed = False

    def _hold(self, signum, frame) -> None:
        if self.held:
            raise KeyboardInterrupt
        self.held = True
        self.sink.append(KeyboardInterrupt())
