"""Kyutai's chat protocol on `python -m moshi_mlx serve --moshi`: our page (or `--static`) at
`/`, `/api/chat`, one conversation per websocket, and `/api/persona`, what a PersonaPlex model
lets a client choose (`serve.chat.persona`).

Everything here runs on the asyncio event loop and never touches MLX: each connection's mic
frames go to its `DuplexSession` (`moshi_mlx.chat.duplex`), stepped on the server's model
thread, whose replies come back in order. Caps, deadlines and liveness come from the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Mapping

from aiohttp import web

from moshi_mlx.chat.duplex import DuplexLag, DuplexReply, DuplexSession
from moshi_mlx.errors import MoshiError, one_line
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.opus import OpusFrameReader, OpusFrameWriter
from moshi_mlx.serve.chat.persona import prompt_choice
from moshi_mlx.serve.chat.protocol import ConversationEnded, Kind, ProtocolError, refuse
from moshi_mlx.serve.chat.service import ChatService, log
from moshi_mlx.serve.context import API_KEY_HEADER, API_KEY_QUERY, ServeContext
from moshi_mlx.serve.http import origin_allowed
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.sessions import (
    BinaryMessages,
    Sessions,
    SilenceWatchdog,
    StoppableConnection,
    close_ended,
    first_to_end,
    live_websocket,
)

CHAT_PATH = "/api/chat"
PERSONA_PATH = "/api/persona"
PING_AFTER_SECONDS = 1.0  # Kyutai's clients give up after 10 s without a message
LAG_NOTICE_EVERY_SECONDS = 1.0
# Frames over this size are refused by the websocket layer itself (close code 1009); between
# protocol.MAX_MESSAGE_BYTES and this, the client gets a 0x05 with the reason.
_WEBSOCKET_MAX_BYTES = 1 << 20


def add_routes(app: web.Application, context: ServeContext) -> None:
    """Mount `CHAT_PATH`, `PERSONA_PATH`, `/` and the page's files (from the settings'
    `static_dir`) for `context.chat`. Mount it last: its static files answer under `/`."""
    service = context.chat
    chat = _ChatHandler(service, context)
    app.router.add_get(CHAT_PATH, chat.handle)
    app.on_shutdown.append(chat.sessions.close_all)

    async def persona(request: web.Request) -> web.StreamResponse:
        _check_key(request, context)
        if not service.ready.is_set():
            return web.json_response({"loading": True}, status=503, headers={"Retry-After": "1"})
        if service.error is not None:
            return web.json_response({"error": "the server could not load the model"}, status=503)
        return web.json_response(service.persona.as_json())

    app.router.add_get(PERSONA_PATH, persona)
    static_dir = service.settings.static_dir.resolve()
    index = static_dir / "index.html"

    async def root(_request: web.Request) -> web.StreamResponse:
        # The static route's rule for `/index.html` too: resolved, it must lie in the folder.
        if not index.is_file() or not index.resolve().is_relative_to(static_dir):
            raise web.HTTPNotFound(text="no index.html in the page's folder")
        return web.FileResponse(index)

    app.router.add_get("/", root)
    # aiohttp resolves each path (symlinks too) and refuses any whose target is outside.
    app.router.add_static("/", static_dir, follow_symlinks=False)
    context.modules.append(
        lambda: {
            "type": "chat",
            "path": CHAT_PATH,
            "used_slots": str(chat.sessions.active),
            "total_slots": str(service.settings.max_conversations),
        }
    )


def _check_key(request: web.Request, context: ServeContext) -> None:
    """With `--api-key`: 401 unless the request sends a key (Kyutai's header, or `?auth_id=`,
    which our page passes on from its own address)."""
    key = request.headers.get(API_KEY_HEADER, request.query.get(API_KEY_QUERY))
    if not context.key_allowed(key):
        context.tally.count("requests refused for a missing or wrong API key", request.remote)
        raise web.HTTPUnauthorized(text=f"send a valid {API_KEY_HEADER} header or ?auth_id=")


class _ChatHandler:
    """`CHAT_PATH`: the protocol of one connection, and the limit on open conversations."""

    def __init__(self, service: ChatService, context: ServeContext):
        self._service = service
        self._context = context
        self._limits = context.limits
        self._tally = context.tally
        self.sessions = Sessions(
            service.settings.max_conversations, context.tally, log, "conversation"
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        _check_key(request, self._context)
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            self._tally.count("websockets refused for their origin", request.remote)
            raise web.HTTPForbidden(text=f"websocket origin {origin} is not this server")
        ws = live_websocket(self._limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        await self.sessions.run(
            request.remote,
            lambda: _Conversation(ws, self._service, self._limits, request.query),
            lambda: refuse(ws, "busy: Moshi is talking with someone else; try again later"),
        )
        return ws


class _Conversation(StoppableConnection):
    """One websocket: decode the client's audio, feed its session, send Moshi's replies."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        service: ChatService,
        limits: Limits,
        query: Mapping[str, str],
    ):
        super().__init__(ws)
        self._service = service
        self._limits = limits
        self._query = query
        self._last_sent = time.monotonic()
        self._opus_in = OpusFrameReader(SAMPLE_RATE, FRAME_SIZE)
        self._opus_out = OpusFrameWriter(SAMPLE_RATE)
        self._session: DuplexSession | None = None
        # Frames that came before the session existed (the model loading), the newest kept.
        self._early: deque = deque(maxlen=4 * service.settings.max_lag_frames + 16)
        self._conversing = asyncio.Event()
        self._silence = SilenceWatchdog(limits.client_silence_timeout)
        self._unreported_drops = 0
        self._total_dropped = 0
        self._last_lag_notice = -LAG_NOTICE_EVERY_SECONDS

    async def run(self) -> str:
        """Converse until the client leaves or something ends it; returns why, for the log."""
        keepalive = asyncio.create_task(self._keep_alive())
        receiving = asyncio.create_task(self._receive())
        try:
            # A ProtocolError or ConversationEnded propagates: the reason goes to the client.
            reason = await first_to_end(receiving, self._converse(), self._watch())
        except (ProtocolError, ConversationEnded) as exc:
            reason = str(exc)
            await refuse(self._ws, reason)
        except ConnectionError:
            reason = "the client left"
        finally:
            keepalive.cancel()
            receiving.cancel()
            if self._session is not None:
                self._session.close()
            await close_ended(self._ws)
        return self._ended(reason)

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
        """Once the model is ready: the session started, the handshake, then its replies."""
        params = protocol.session_params(
            self._query, self._service.settings.sampling, self._service.settings.seed
        )
        while not self._service.ready.is_set():  # the model is loading; pings keep going
            await asyncio.sleep(0.1)
        if self._service.error is not None:
            raise ConversationEnded("the server could not load the model")
        voice, role = prompt_choice(self._query, self._service.persona)
        session = self._service.session(params.sampling, params.seed, voice, role)
        for frame in self._early:  # audio before the handshake is kept for the model
            session.push(frame)
        self._early.clear()
        self._session = session
        try:
            seed = await session.start()
        except MoshiError as exc:
            raise ConversationEnded(f"cannot start a conversation: {one_line(exc)}") from None
        self._conversing.set()
        await self._send(protocol.handshake())
        await self._send(protocol.metadata(self._metadata(seed)))
        while True:
            try:
                event = await session.next()
            except MoshiError as exc:
                raise ConversationEnded(str(exc)) from None
            if isinstance(event, DuplexReply):
                pages = self._opus_out.encode(event.pcm)
                if pages:
                    await self._send(protocol.audio(pages))
                if event.text:
                    await self._send(protocol.text(event.text))
                await self._report_lag()
            elif isinstance(event, DuplexLag):
                self._unreported_drops += event.dropped
                self._total_dropped = event.total
                await self._report_lag()

    async def _receive(self) -> str:
        """Client messages until it leaves."""
        messages = BinaryMessages(self._ws, self._limits, ProtocolError, "send binary messages")
        async for data in messages:
            kind, payload = protocol.parse(data)
            if kind == Kind.AUDIO:
                self._silence.heard()
                for frame in self._opus_in.feed(payload):
                    if self._session is None:
                        self._early.append(frame)
                    else:
                        self._session.push(frame)
            # Other known kinds (handshake, ping, control, ...) carry nothing for us.
        return messages.ended

    async def _watch(self) -> None:
        """End a conversation whose client sends no audio (from the handshake on)."""
        await self._conversing.wait()
        raise ConversationEnded(await self._silence.ended())

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
        text, audio = self._session.sampling
        return {
            "server": "moshi_mlx",
            "seed": seed,
            "text_temperature": text.temp,
            "text_topk": text.top_k,
            "audio_temperature": audio.temp,
            "audio_topk": audio.top_k,
            "frame_ms": 1000 * FRAME_SIZE // SAMPLE_RATE,
            "max_lag_frames": self._session.max_lag_frames,
        }
