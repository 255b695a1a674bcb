"""Python's garbage collector and what the engine's warm-up leaves behind.

torch.compile, dynamo and the CUDA graph captures leave ~10^5-10^6 long-lived objects tracked by Python's cycle
collector. Python walks every tracked object in each full collection, and runs one whenever the objects promoted to
its oldest generation since the last exceed a quarter of that generation: every few ``generate_many`` calls of a
chat-sized batch (each request's own state is what gets promoted), a pause of ~0.3 s on an H100 machine's host
(``notes/engine_perf.md``, session 18). Freezing the heap after a capture (``gc.freeze``; vLLM does the same after
its warm-up) takes those objects out of every later collection. The freeze is undone whenever the engine drops what
it captured, so that what it lets go of can be collected even where it sits in a reference cycle.
"""

from __future__ import annotations

import atexit
import gc

_thaw_at_exit = []  # the atexit registration, made once at the first freeze


class HeapFreeze:
    """A runner's freeze of the heap after its captures (``EngineConfig.freeze_gc``)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.frozen = False

    def freeze(self) -> None:
        """Collect what is garbage now (a frozen cycle is never collected), then freeze everything still alive."""
        if self.enabled:
            gc.collect()
            gc.freeze()
            self.frozen = True
            if not _thaw_at_exit:  # let the interpreter's last collection reach the frozen objects, as without it
                _thaw_at_exit.append(atexit.register(gc.unfreeze))

    def thaw(self) -> None:
        """Undo ``freeze``. Process-wide: another engine's freeze is undone too, until that engine captures again."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
