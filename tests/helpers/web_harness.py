"""The chat route of `python -m moshi_mlx serve` inside the test process (the serve app over a
`ChatService` on a `ModelThread`), and a small protocol client."""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
from collections.abc import Callable

import aiohttp
import numpy as np
import sphn
from aiohttp import web

from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.service import ChatService, ChatSettings, log
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.limits import Limits

FRAME = 1920


def free_port() -> int:
    """A localhost TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerThread:
    """A chat model loading (`load`) on its model thread as `serve --moshi` loads it, and serve
    apps over it (each with its own settings and limits) on an event loop of their own."""

    def __init__(self, load: Callable, settings: ChatSettings | None = None):
        self.thread = ModelThread()
        self.thread.start()
        self.service = ChatService(self.thread, load, settings)
        self.service.start()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._loop_thread.start()
        self._runners: list[web.AppRunner] = []
        self.guards: dict[int, ConnectionGuard] = {}  # by port

    def serve(
        self,
        settings: ChatSettings | None = None,
        limits: Limits | None = None,
        ssl_context=None,
        host: str = "127.0.0.1",
        loopback_only: bool = False,
        api_keys: frozenset[str] = frozenset(),
    ) -> int:
        """Start an app with `settings` (the service's model, other settings) on a free port
        of `host`; returns the port."""
        return asyncio.run_coroutine_threadsafe(
            self._serve(settings, limits or Limits(), ssl_context, host, loopback_only, api_keys),
            self._loop,
        ).result(30)

    async def _serve(self, settings, limits, ssl_context, host, loopback_only, api_keys) -> int:
        service = self.service
        if settings is not None:  # the same model and sessions, other settings
            service = copy.copy(service)
            service.settings = settings
        guard = ConnectionGuard(limits, EventTally(log))
        context = ServeContext(
            self.thread,
            guard.tally,
            limits,
            api_keys=api_keys,
            chat=service,
            loopback_only=loopback_only,
        )
        runner = guard.app_runner(create_app(context, guard), access_log=None)
        await runner.setup()
        await guard.site(runner, host, 0, ssl_context).start()
        self._runners.append(runner)
        port = runner.addresses[0][1]
        self.guards[port] = guard
        return port

    def close(self) -> None:
        async def cleanup():
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)
        self.service.stop()
        self.thread.stop()


def ogg_pages(pcm: np.ndarray) -> list[bytes]:
    """`pcm` (24 kHz float32) as the Ogg Opus pages that sphn writes, 80 ms per call."""
    writer = sphn.OpusStreamWriter(24_000)
    pages = []
    for start in range(0, len(pcm) - FRAME + 1, FRAME):
        data = writer.append_pcm(pcm[start : start + FRAME])
        if data:
            pages.append(data)
    return pages


def decode_ogg(chunks: list[bytes]) -> np.ndarray:
    reader = sphn.OpusStreamReader(24_000)
    decoded = [reader.append_bytes(chunk) for chunk in chunks]
    return np.concatenate([d for d in decoded if d.size] or [np.zeros(0, np.float32)])


class Reply:
    """What a client collected: messages by kind, Moshi's audio bytes and text."""

    def __init__(self):
        self.messages: list[bytes] = []
        self.audio: list[bytes] = []
        self.text = ""
        self.closed = False

    def of_kind(self, kind: protocol.Kind) -> list[bytes]:
        return [m[1:] for m in self.messages if m and m[0] == kind]

    @property
    def error(self) -> str | None:
        errors = self.of_kind(protocol.Kind.ERROR)
        return errors[0].decode() if errors else None


async def read_until(ws, reply: Reply, done, timeout: float = 30.0) -> Reply:
    """Collect messages into `reply` until `done(reply)`, the server closes, or `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done(reply):
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(f"timed out; got kinds {[m[:1] for m in reply.messages][:40]}")
        message = await ws.receive(timeout=left)
        if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
            reply.closed = True
            return reply
        if message.type == aiohttp.WSMsgType.BINARY:
            data = message.data
            reply.messages.append(data)
            if data[0] == protocol.Kind.AUDIO:
                reply.audio.append(data[1:])
            elif data[0] == protocol.Kind.TEXT:
                reply.text += data[1:].decode()
    return reply


def has_handshake(reply: Reply) -> bool:
    return bool(reply.of_kind(protocol.Kind.HANDSHAKE))
