"""The HTTP side: our page (or `--static`), and `/api/chat`, one conversation per websocket.

Everything here runs on the asyncio event loop and never touches MLX: mic frames go to the
`ModelWorker` thread, its events come back through an `asyncio.Queue` per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from moshi_mlx.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.sampling import SamplingConfig
from moshi_mlx.web import protocol
from moshi_mlx.web.opus import OpusFrameReader, OpusFrameWriter
from moshi_mlx.web.protocol import Kind, ProtocolError
from moshi_mlx.web.worker import Failed, Lag, ModelWorker, Ready, Reply, Session

PAGE_DIR = Path(__file__).parent / "static"
PING_AFTER_SECONDS = 1.0  # Kyutai's clients give up after 10 s without a message
LAG_NOTICE_EVERY_SECONDS = 1.0
SLOT_GRACE_SECONDS = 1.0
# Frames over this size are refused by the websocket layer itself (close code 1009); between
# protocol.MAX_MESSAGE_BYTES and this, the client gets a 0x05 with the reason.
_WEBSOCKET_MAX_BYTES = 1 << 20

log = logging.getLogger("moshi_mlx.web")


@dataclass(frozen=True)
class ServerConfig:
    """What the server's flags decide for every connection."""

    sampling: SamplingConfig
    seed: int | None = None
    max_lag_frames: int = 3
    max_conversations: int = 1
    static_dir: Path = PAGE_DIR
    # Bound to a loopback address: answer only requests for a loopback name, so a web page
    # whose domain was re-pointed at 127.0.0.1 (DNS rebinding) cannot reach the server.
    loopback_only: bool = False


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (the only hosts that need no https)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(worker: ModelWorker, config: ServerConfig) -> web.Application:
    """The aiohttp application: `/` and static files from `config.static_dir`, `/api/chat`."""
    chat = _ChatHandler(worker, config)
    app = web.Application(middlewares=[_loopback_guard] if config.loopback_only else [])
    app.router.add_get("/api/chat", chat.handle)
    index = config.static_dir / "index.html"

    async def root(_request: web.Request) -> web.StreamResponse:
        if not index.is_file():
            raise web.HTTPNotFound(text=f"no index.html in {config.static_dir}")
        return web.FileResponse(index)

    app.router.add_get("/", root)
    # aiohttp's static resource resolves each path and refuses anything outside the folder.
    app.router.add_static("/", config.static_dir, follow_symlinks=False)
    return app


@web.middleware
async def _loopback_guard(request: web.Request, handler) -> web.StreamResponse:
    name = _host_port(request.host or "", 80)[0]
    if not is_loopback(name):
        log.warning("refused a request for host %s", request.host)
        raise web.HTTPForbidden(text=f"this server answers only for localhost, not {name}")
    return await handler(request)


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """A browser's websocket must come from a page of this server: Origin's host:port == Host.

    Clients that send no Origin (`moshi.client`, the Rust CLI) are not browsers and pass.
    """
    if origin is None:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or host is None:
        return False
    default_port = {"http": 80, "https": 443}[parts.scheme]
    return _host_port(parts.netloc, default_port) == _host_port(host, default_port)


def _host_port(netloc: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port or default_port
    except ValueError:
        port = -1
    return (parts.hostname or "").lower(), port


class _ChatHandler:
    """`/api/chat`: the protocol of one connection, and the limit on open conversations."""

    def __init__(self, worker: ModelWorker, config: ServerConfig):
        self._worker = worker
        self._config = config
        self._active = 0
        self._slots = asyncio.Condition()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            log.warning("refused a websocket from origin %s (host %s)", origin, request.host)
            raise web.HTTPForbidden(text=f"websocket origin {origin} is not this server")
        ws = web.WebSocketResponse(max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        peer = request.remote
        if not await self._take_slot():
            log.info("%s: refused, busy", peer)
            await _fail(ws, "busy: Moshi is talking with someone else; try again later")
            return ws
        try:
            log.info("%s: conversation started", peer)
            await _Connection(ws, self._worker, self._config, request.query).run()
        finally:
            async with self._slots:
                self._active -= 1
                self._slots.notify_all()
            log.info("%s: connection closed", peer)
        return ws

    async def _take_slot(self) -> bool:
        """A free conversation slot, waiting a moment for one that is being freed (a client
        that reconnects right after leaving)."""
        async with self._slots:
            try:
                await asyncio.wait_for(
                    self._slots.wait_for(lambda: self._active < self._config.max_conversations),
                    SLOT_GRACE_SECONDS,
                )
            except asyncio.TimeoutError:
                return False
            self._active += 1
            return True


class _ConversationEnded(Exception):
    """The server cannot go on with a conversation; the reason goes to the client as 0x05."""


async def _fail(ws: web.WebSocketResponse, reason: str) -> None:
    """Send 0x05 with the reason and close; a client that already left is fine."""
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ws.send_bytes(protocol.error(reason))
    await ws.close()


class _Connection:
    """One websocket: decode the client's audio, feed the worker, send Moshi's replies."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        worker: ModelWorker,
        config: ServerConfig,
        query: Mapping[str, str],
    ):
        self._ws = ws
        self._worker = worker
        self._config = config
        self._query = query
        self._events: asyncio.Queue = asyncio.Queue()
        self._last_sent = time.monotonic()
        self._opus_in = OpusFrameReader(SAMPLE_RATE, FRAME_SIZE)
        self._opus_out = OpusFrameWriter(SAMPLE_RATE)
        self._session: Session | None = None
        self._unreported_drops = 0
        self._total_dropped = 0
        self._last_lag_notice = -LAG_NOTICE_EVERY_SECONDS

    async def run(self) -> None:
        keepalive = asyncio.create_task(self._keep_alive())
        try:
            await self._converse()
        except (ProtocolError, _ConversationEnded) as exc:
            log.info("closing a connection: %s", exc)
            await _fail(self._ws, str(exc))
        except ConnectionError:
            pass  # the client left
        finally:
            keepalive.cancel()
            if self._session is not None:
                self._worker.release(self._session)
            if not self._ws.closed:
                await self._ws.close()

    async def _send(self, message: bytes) -> None:
        self._last_sent = time.monotonic()
        await self._ws.send_bytes(message)

    async def _keep_alive(self) -> None:
        """Ping whenever nothing else went out for a while (model loading, no mic audio)."""
        while not self._ws.closed:
            await asyncio.sleep(PING_AFTER_SECONDS / 4)
            if time.monotonic() - self._last_sent >= PING_AFTER_SECONDS:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await self._send(protocol.ping())

    async def _converse(self) -> None:
        params = protocol.session_params(self._query, self._config.sampling, self._config.seed)
        loop = asyncio.get_running_loop()
        events = self._events

        def deliver(event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        self._session = Session(params.sampling, params.seed, deliver, self._config.max_lag_frames)
        receiving = asyncio.create_task(self._receive())
        try:
            while not self._worker.ready.is_set():  # the model is loading; pings keep going
                await asyncio.wait((receiving,), timeout=0.1)
                if receiving.done():
                    receiving.result()
                    return
        except BaseException:
            receiving.cancel()
            raise
        if self._worker.error is not None:
            receiving.cancel()
            raise _ConversationEnded("the server could not load the model")
        self._worker.open(self._session)
        replying = asyncio.create_task(self._reply())
        done, pending = await asyncio.wait(
            (receiving, replying), return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # a ProtocolError or _ConversationEnded: the reason goes to the client

    async def _receive(self) -> None:
        """Client messages until it leaves; audio before the handshake is kept for the model."""
        async for message in self._ws:
            if message.type == aiohttp.WSMsgType.ERROR:
                return
            if message.type != aiohttp.WSMsgType.BINARY:
                raise ProtocolError(
                    f"{message.type.name.lower()} messages are not part of the protocol; "
                    "send binary messages"
                )
            kind, payload = protocol.parse(message.data)
            if kind == Kind.AUDIO:
                for frame in self._opus_in.feed(payload):
                    self._worker.submit(self._session, frame)
            # Other known kinds (handshake, ping, control, ...) carry nothing for us.

    async def _reply(self) -> None:
        """Worker events out to the client: handshake, audio, text, lag notices."""
        while True:
            event = await self._events.get()
            if isinstance(event, Reply):
                pages = self._opus_out.encode(event.pcm)
                if pages:
                    await self._send(protocol.audio(pages))
                if event.text:
                    await self._send(protocol.text(event.text))
                await self._report_lag()
            elif isinstance(event, Ready):
                await self._send(protocol.handshake())
                await self._send(protocol.metadata(self._metadata(event.seed)))
            elif isinstance(event, Lag):
                self._unreported_drops += event.dropped
                self._total_dropped = event.total
                await self._report_lag()
            elif isinstance(event, Failed):
                raise _ConversationEnded(event.reason)

    async def _report_lag(self) -> None:
        """Tell the client about dropped mic audio, at most once a second."""
        now = time.monotonic()
        if not self._unreported_drops or now - self._last_lag_notice < LAG_NOTICE_EVERY_SECONDS:
            return
        lag = {
            "dropped_frames": self._unreported_drops,
            "total_dropped": self._total_dropped,
        }
        self._unreported_drops, self._last_lag_notice = 0, now
        await self._send(protocol.metadata({"lag": lag}))

    def _metadata(self, seed: int) -> dict:
        sampling = self._session.sampling
        return {
            "server": "moshi_mlx",
            "seed": seed,
            "text_temperature": sampling.text_temp,
            "text_topk": sampling.text_top_k,
            "audio_temperature": sampling.audio_temp,
            "audio_topk": sampling.audio_top_k,
            "frame_ms": 1000 * FRAME_SIZE // SAMPLE_RATE,
            "max_lag_frames": self._config.max_lag_frames,
        }
