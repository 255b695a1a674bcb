"""Messages between the server process and the front-end process: pickles framed by their length on a socket.

One frame = 8-byte big-endian length + a pickle. The server process uses blocking sockets (a reader thread,
and ``send`` from the engine thread); the front end reads with asyncio and writes without blocking. A socket
buffer of a few MB lets the engine run ahead of a front end that is momentarily behind; a front end that
stays behind slows the engine down (backpressure) instead of letting the backlog grow without limit.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import Any

from .messages import FrontendGone

_HEADER = struct.Struct("!Q")
SOCKET_BUFFER_BYTES = 4 << 20  # asked for; the kernel caps it (net.core.wmem_max / rmem_max)


def encode(message: Any) -> bytes:
    """One frame: length + pickle of ``message``."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets with large buffers (one end for each process)."""
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for sock in pair:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return pair


class Channel:
    """The blocking end of a socket: ``send`` from any thread, ``recv`` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Write one message; raises ``FrontendGone`` once the other end is closed."""
        frame = encode(message)
        try:
            with self.lock:
                self.sock.sendall(frame)
        except OSError as exc:
            raise FrontendGone(f"the other process is gone ({exc})") from None

    def recv(self) -> Any:
        """Read one message; raises ``EOFError`` once the other end is closed."""
        (size,) = _HEADER.unpack(self._read(_HEADER.size))
        return pickle.loads(self._read(size))

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            count = self.sock.recv_into(view[done:])
            if count == 0:
                raise EOFError("the other process closed the channel")
            done += count
        return buffer

    def close(self) -> None:
        self.sock.close()


async def read_message(reader: asyncio.StreamReader) -> Any:
    """Read one message on the event loop; raises ``asyncio.IncompleteReadError`` once the channel closed."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))
