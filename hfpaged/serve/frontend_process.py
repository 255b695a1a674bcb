"""The server process's handle on its HTTP front end: a child process, and the channel to it.

The child is a fresh interpreter (``subprocess``, not ``multiprocessing``: nothing of the caller's ``__main__``
is re-imported, so ``hfpaged.serve(model, tokenizer)`` works from any script). It inherits two file
descriptors: the listening HTTP socket (bound here, so ``Server.url`` is known before it starts) and its
end of a Unix socket pair. The first message on the pair is the ``FrontendConfig`` (the pickled tokenizer
among it); after that the child sends engine commands and ``FrontendReady``, and reads engine results and
``Shutdown``. When the channel closes (the child ended, however) the engine gets ``StopEngine``: whatever
the front end left running is aborted and its blocks freed.

The child imports ``hfpaged.serve.frontend`` without running ``hfpaged/__init__.py`` (which imports torch and
the engine): the front end needs neither, and starts in a fraction of the time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .channel import Channel, socket_pair
from .messages import FrontendConfig, FrontendGone, FrontendReady, Shutdown, StopEngine

logger = logging.getLogger("hfpaged.serve")

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../hfpaged
# Run in the child with ``python -c``: an empty ``hfpaged`` package object (its path only), then the front end.
_BOOTSTRAP = """
import importlib.machinery, sys, types
package = types.ModuleType("hfpaged")
package.__path__ = [sys.argv[1]]
package.__spec__ = importlib.machinery.ModuleSpec("hfpaged", None, is_package=True)
package.__spec__.submodule_search_locations = package.__path__
sys.modules["hfpaged"] = package
from hfpaged.serve.frontend import main
main(int(sys.argv[2]))
"""


class FrontendProcess:
    """Starts the front-end process, forwards its engine commands to ``on_command``, and stops it."""

    def __init__(self, on_command: Callable[[Any], None]):
        self.on_command = on_command
        self.ready = threading.Event()
        self.process: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The front-end process's id once it started."""
        return None if self.process is None else self.process.pid

    def spawn(self, config: FrontendConfig, http_socket: socket.socket) -> None:
        """Start the child on ``http_socket`` and send it ``config``."""
        ours, theirs = socket_pair()
        config.http_fd = http_socket.fileno()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, PACKAGE_DIR, str(theirs.fileno())],
                pass_fds=(theirs.fileno(), http_socket.fileno()),
            )
        finally:
            theirs.close()
        self.channel = Channel(ours)
        self.channel.send(config)
        self.reader = threading.Thread(target=self._read, name="hfpaged-frontend-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.recv()
                if isinstance(message, FrontendReady):
                    self.ready.set()
                else:
                    self.on_command(message)
        except (EOFError, OSError):
            pass
        finally:
            self.on_command(StopEngine())  # the front end is gone: abort what it left running

    def wait_ready(self, timeout: float) -> None:
        """Until the child accepts HTTP connections; raises if it exits or takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.02):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the hfpaged front-end process exited with code {self.process.returncode} (see the log above)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the hfpaged front-end process did not start within {timeout} s")

    def send(self, message: Any) -> None:
        """Write a message to the child (the engine thread's outputs, ``Shutdown``); ``FrontendGone`` if it ended."""
        self.channel.send(message)

    def shutdown(self, timeout: float) -> None:
        """Ask the child to stop gracefully and wait ``timeout`` s for it to exit; kill it after that."""
        if self.process is None:
            return
        with contextlib.suppress(FrontendGone):
            self.send(Shutdown())
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("hfpaged: the front-end process did not stop within %s s; killing it", timeout)
            self.process.kill()
            self.process.wait()
        if self.reader is not None:
            self.reader.join(timeout)
        self.channel.close()
