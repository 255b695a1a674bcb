"""The server process's handle on its HTTP front ends: child processes, the channels to them, their sockets.

The child is a fresh interpreter (``subprocess``, not ``multiprocessing``: nothing of the caller's ``__main__``
is re-imported, so ``hfpaged.serve(model, tokenizer)`` works from any script). It inherits two file
descriptors: the listening HTTP socket (bound here, so ``Server.url`` is known before it starts) and its
end of a Unix socket pair. The first message on the pair is the ``FrontendConfig`` (the pickled tokenizer
among it); after that the child sends engine commands and ``FrontendReady``, and reads engine results and
``Shutdown``. When the channel closes (the child ended, however) the engine gets ``StopEngine``: whatever
the front end left running is aborted and its blocks freed.

The child imports ``hfpaged.serve.frontend`` without running ``hfpaged/__init__.py`` (which imports torch and
the engine): the front end needs neither, and starts in a fraction of the time.

Several front ends (``api_server_count``, as vLLM's ``--api-server-count``) each get a channel of their own
and a listening socket: on Linux one socket per front end, all bound to the same port with ``SO_REUSEPORT``
by this process, so that the kernel spreads incoming connections over them by a hash of the connection's
addresses. One socket shared by all (uvicorn's ``--workers`` model) works too, but whichever event loop wakes
first takes every connection queued at that moment (asyncio and uvloop accept in a loop until the queue is
empty), so a burst of clients lands on one front end. Elsewhere they do share one socket.
"""

from __future__ import annotations

import contextlib
import errno
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


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on ``host:port`` (port 0: a free one, the same for all), one per front end
    (``SO_REUSEPORT``, Linux); one socket for all where that is not available or ``count`` is 1. A port in use is
    an ``OSError`` (``EADDRINUSE``) naming it."""
    try:
        return _listening_sockets(host, port, count)
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            raise
        message = f"cannot listen on {host}:{port}: the address is in use (another server?)"
        raise OSError(error.errno, message) from None


def _listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reuse_port = count > 1 and sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    sockets: list[socket.socket] = []
    if reuse_port:  # a port another process listens on (with SO_REUSEPORT too) must fail here, not be joined
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]
    try:
        for _ in range(count if reuse_port else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # the others join the port the first one got
            sock.listen(2048)  # connections queue up from now on, before the front end accepts them
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets if reuse_port else sockets * count


class FrontendProcess:
    """Starts one front-end process, forwards its engine commands to ``on_command``, and stops it.
    ``metrics_dir``: the ``PROMETHEUS_MULTIPROC_DIR`` shared by several front ends (None: just one)."""

    def __init__(self, on_command: Callable[[Any], None], *, metrics_dir: str | None = None):
        self.on_command = on_command
        self.metrics_dir = metrics_dir
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
        config.metrics_dir = self.metrics_dir
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # read when the child imports prometheus_client
        if self.metrics_dir is not None:
            env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, PACKAGE_DIR, str(theirs.fileno())],
                pass_fds=(theirs.fileno(), http_socket.fileno()),
                env=env,
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
            if self.metrics_dir is not None:  # its running/waiting gauges no longer count
                from prometheus_client.multiprocess import mark_process_dead

                with contextlib.suppress(OSError):
                    mark_process_dead(self.process.pid, self.metrics_dir)

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
        self.ask_to_stop()
        self.wait_stopped(timeout)

    def ask_to_stop(self) -> None:
        """Tell the child to stop gracefully (in-flight requests get its ``shutdown_timeout``)."""
        if self.process is not None:
            with contextlib.suppress(FrontendGone):
                self.send(Shutdown())

    def wait_stopped(self, timeout: float) -> None:
        """Wait ``timeout`` s for the child to exit, kill it after that; close the channel."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("hfpaged: the front-end process did not stop within %s s; killing it", timeout)
            self.process.kill()
            self.process.wait()
        except BaseException:  # a second Ctrl-C while it stops gracefully: stop at once, and never leave it behind
            self.process.kill()
            self.process.wait()
            raise
        if self.reader is not None:
            self.reader.join(timeout)
        self.channel.close()
