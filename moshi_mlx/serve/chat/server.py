"""The HTTP side: our page (or `--static`), `/api/chat`, one conversation per websocket, and
`/api/persona`, what a PersonaPlex model lets a client choose (`web.persona`).

Everything here runs on the asyncio event loop and never touches MLX: mic frames go to the
`ModelWorker` thread, its events come back through an `asyncio.Queue` per connection. Caps,
deadlines and liveness checks come from `guard.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.sampling import SamplingConfig
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.opus import OpusFrameReader, OpusFrameWriter
from moshi_mlx.serve.chat.persona import prompt_choice
from moshi_mlx.serve.chat.protocol import ConversationEnded, Kind, ProtocolError, refuse
from moshi_mlx.serve.chat.worker import Failed, Lag, ModelWorker, Ready, Reply, Session
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.http import loopback_only, origin_allowed
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.sessions import (
    BinaryMessages,
    Sessions,
    SilenceWatchdog,
    close_ended,
    close_going_away,
    first_to_end,
    live_websocket,
)

PAGE_DIR = Path(__file__).parent / "static"
PING_AFTER_SECONDS = 1.0  # Kyutai's clients give up after 10 s without a message
LAG_NOTICE_EVERY_SECONDS = 1.0
# Frames over this size are refused by the websocket layer itself (close code 1009); between
# protocol.MAX_MESSAGE_BYTES and this, the client gets a 0x05 with the reason.
_WEBSOCKET_MAX_BYTES = 1 << 20

log = logging.getLogger("moshi_mlx.serve.chat")


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
    limits: Limits = field(default_factory=Limits)


def create_app(
    worker: ModelWorker, config: ServerConfig, guard: ConnectionGuard
) -> web.Application:
    """The aiohttp application: `/` and static files from `config.static_dir`, `/api/chat`;
    served through `guard` (its runner and site), which also counts what is refused."""
    chat = _ChatHandler(worker, config, guard.tally)
    middlewares = [guard.middleware]
    if config.loopback_only:
        middlewares.append(loopback_only(guard.tally))
    app = web.Application(middlewares=middlewares)
    app.router.add_get("/api/chat", chat.handle)
    app.on_shutdown.append(chat.sessions.close_all)

    async def persona(_request: web.Request) -> web.StreamResponse:
        if not worker.ready.is_set():
            return web.json_response({"loading": True}, status=503, headers={"Retry-After": "1"})
        if worker.error is not None:
            return web.json_response({"error": "the server could not load the model"}, status=503)
        return web.json_response(worker.persona.as_json())

    app.router.add_get("/api/persona", persona)
    static_dir = config.static_dir.resolve()
    index = static_dir / "index.html"

    async def root(_request: web.Request) -> web.StreamResponse:
        # The static route's rule for `/index.html` too: resolved, it must lie in the folder.
        if not index.is_file() or not index.resolve().is_relative_to(static_dir):
            raise web.HTTPNotFound(text=f"no index.html in {static_dir}")
        return web.FileResponse(index)

    app.router.add_get("/", root)
    # aiohttp resolves each path (symlinks too) and refuses any whose target is outside.
    app.router.add_static("/", static_dir, follow_symlinks=False)
    return app


class _ChatHandler:
    """`/api/chat`: the protocol of one connection, and the limit on open conversations."""

    def __init__(self, worker: ModelWorker, config: ServerConfig, tally: EventTally):
        self._worker = worker
        self._config = config
        self._tally = tally
        self.sessions = Sessions(config.max_conversations, tally, log, "conversation")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            self._tally.count("websockets refused for their origin", request.remote)
            raise web.HTTPForbidden(text=f"websocket origin {origin} is not this server")
        ws = live_websocket(self._config.limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        await self.sessions.run(
            request.remote,
            lambda: _Connection(ws, self._worker, self._config, request.query),
            lambda: refuse(ws, "busy: Moshi is talking with someone else; try again later"),
        )
        return ws


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
        self._conversing = asyncio.Event()
        self._silence = SilenceWatchdog(config.limits.client_silence_timeout)
        self._stopping = False
        self._unreported_drops = 0
        self._total_dropped = 0
        self._last_lag_notice = -LAG_NOTICE_EVERY_SECONDS

    async def run(self) -> str:
        """Converse until the client leaves or something ends it; returns why, for the log."""
        keepalive = asyncio.create_task(self._keep_alive())
        try:
            reason = await self._converse()
        except (ProtocolError, ConversationEnded) as exc:
            reason = str(exc)
            await refuse(self._ws, reason)
        except ConnectionError:
            reason = "the client left"
        finally:
            keepalive.cancel()
            if self._session is not None:
                self._worker.release(self._session)
            await close_ended(self._ws)
        return "the server is stopping" if self._stopping else reason

    async def stop(self) -> None:
        """Close with 1001 (going away): the server is shutting down."""
        self._stopping = True
        await close_going_away(self._ws)

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

    async def _converse(self) -> str:
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
                    return receiving.result()
        except BaseException:
            receiving.cancel()
            raise
        if self._worker.error is not None:
            receiving.cancel()
            raise ConversationEnded("the server could not load the model")
        try:
            self._session.voice, self._session.role = prompt_choice(
                self._query, self._worker.persona
            )
        except ProtocolError:
            receiving.cancel()
            raise
        self._worker.open(self._session)
        # A ProtocolError or ConversationEnded propagates: the reason goes to the client.
        return await first_to_end(receiving, self._reply(), self._watch())

    async def _receive(self) -> str:
        """Client messages until it leaves; audio before the handshake is kept for the model."""
        messages = BinaryMessages(
            self._ws, self._config.limits, ProtocolError, "send binary messages"
        )
        async for data in messages:
            kind, payload = protocol.parse(data)
            if kind == Kind.AUDIO:
                self._silence.heard()
                for frame in self._opus_in.feed(payload):
                    self._worker.submit(self._session, frame)
            # Other known kinds (handshake, ping, control, ...) carry nothing for us.
        return messages.ended

    async def _watch(self) -> None:
        """End a conversation whose client sends no audio (from the handshake on)."""
        await self._conversing.wait()
        self._silence.heard()
        await self._silence.expired()
        raise ConversationEnded(
            f"no audio from the client for {self._config.limits.client_silence_timeout:g} s"
        )

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
                self._conversing.set()
                await self._send(protocol.handshake())
                await self._send(protocol.metadata(self._metadata(event.seed)))
            elif isinstance(event, Lag):
                self._unreported_drops += event.dropped
                self._total_dropped = event.total
                await self._report_lag()
            elif isinstance(event, Failed):
                raise ConversationEnded(event.reason)

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
