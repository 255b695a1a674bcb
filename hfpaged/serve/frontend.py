"""The front-end process: uvicorn + the FastAPI app, talking to the engine in the process that holds the model.

Everything per token that is not engine work happens here, on one event loop with a GIL of its own:
request validation, chat templates and tokenization, routing token deltas, detokenization, stop strings,
SSE/JSON formatting, metrics, 429s, disconnects. Started by ``FrontendProcess`` (which see); the engine
side's messages arrive on the inherited channel, one per engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import pickle
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from .app import build_app
from .channel import Channel, encode, read_message
from .context import ServingContext
from .engine_client import EngineClient
from .logprobs import TokenStrings
from .messages import FrontendConfig, FrontendReady, Shutdown
from .uvicorn_server import Server as UvicornServer

logger = logging.getLogger("hfpaged.serve")


def main(channel_fd: int) -> None:
    """Entry point of the child: read the config on the channel, serve until told to stop or orphaned."""
    channel_socket = socket.socket(fileno=channel_fd)
    config: FrontendConfig = Channel(channel_socket).recv()
    sys.path.extend(path for path in config.sys_path if path not in sys.path)  # before the tokenizer's classes load
    tokenizer = pickle.loads(config.tokenizer)
    client = EngineClient(
        max_waiting=config.max_waiting,
        stats=config.stats,
        api_server_index=config.api_server_index,
        metrics_dir=config.metrics_dir,
    )
    ctx = ServingContext(
        engine=client,
        tokenizer=tokenizer,
        model_name=config.model_name,
        limits=config.limits,
        token_strings=TokenStrings(tokenizer),
        created=int(time.time()),
    )
    server: uvicorn.Server | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reader, writer = await asyncio.open_unix_connection(sock=channel_socket)
        client.connect(lambda message: writer.write(encode(message)))
        tasks = [
            asyncio.ensure_future(_read_engine(reader, client, server)),
            asyncio.ensure_future(_announce_ready(server, writer)),
        ]
        # once nothing reads the engine's messages (cancelled when a second Ctrl-C forces the exit), client.stop()
        # below must not wait its 60 s for one
        tasks[0].add_done_callback(lambda _: client.lost("the front end stopped reading the engine's messages"))
        try:
            yield
        finally:
            await client.stop()
            for task in tasks:
                task.cancel()
            writer.close()

    app = build_app(ctx, lifespan)
    server = UvicornServer(app, config.log_level, config.shutdown_timeout)
    http_socket = socket.socket(fileno=config.http_fd)
    # uvicorn re-raises the signal that stopped it once it is done; SIGTERM then ends this process quietly
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    gc.freeze()  # what is loaded now lives as long as the process: keep the collector from scanning it
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[http_socket])


async def _read_engine(reader: asyncio.StreamReader, client: EngineClient, server: uvicorn.Server) -> None:
    """Hand each engine message to the client; ``Shutdown`` (or a closed channel) stops the server."""
    try:
        while True:
            message = await read_message(reader)
            if isinstance(message, Shutdown):
                server.should_exit = True
            else:
                client.receive(message)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        client.lost(f"the engine process closed the channel ({type(exc).__name__})")
        server.should_exit = True
    except Exception:  # pragma: no cover - a bug: nothing more can be served
        logger.exception("hfpaged front end: reading the engine's messages failed")
        client.lost("the front end could not read the engine's messages")
        server.should_exit = True


async def _announce_ready(server: uvicorn.Server, writer: Any) -> None:
    while not server.started:
        await asyncio.sleep(0.005)
    writer.write(encode(FrontendReady()))
