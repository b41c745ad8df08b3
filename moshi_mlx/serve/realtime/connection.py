"""One websocket of `/v1/realtime`: JSON text messages in, each a client event for the
`RealtimeSession`; the session's events out as JSON text, in order.

Limits: a message over `MAX_MESSAGE_BYTES` closes the socket (1009, aiohttp's check); one
that is not a JSON object, not text, or an event the session refuses gets an `error` event
and the session goes on; a client that leaves over `MAX_UNSENT_BYTES` of events unread is
closed (1008) with that reason. Client data reaches the log only through `capped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from moshi_mlx.errors import MoshiError, one_line
from moshi_mlx.realtime import RealtimeSession, SessionError
from moshi_mlx.realtime.events import error
from moshi_mlx.serve.bodies import BadBody, json_value
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.logtext import capped
from moshi_mlx.serve.sessions import (
    StoppableConnection,
    broken_reason,
    close_ended,
    first_to_end,
)

log = logging.getLogger("moshi_mlx.serve.realtime")

# A text message: an append of about 8 s of 24 kHz pcm16 audio in base64 fits.
MAX_MESSAGE_BYTES = 1 << 20
# Events waiting for a client that does not read (about 1.5 minutes of 24 kHz audio deltas).
MAX_UNSENT_BYTES = 8 << 20


class SessionEnded(Exception):
    """The session ends for this reason (sent as the close reason)."""


MakeSession = Callable[[Callable[[dict[str, Any]], None]], Awaitable[RealtimeSession]]


class RealtimeConnection(StoppableConnection):
    """One client's session (a `serve.sessions.LiveConnection`); `make_session(emit)` builds
    it (not started)."""

    def __init__(self, ws: web.WebSocketResponse, make_session: MakeSession, limits: Limits):
        super().__init__(ws)
        self._make_session = make_session
        self._limits = limits
        self._outbox: deque[str] = deque()
        self._unsent = 0
        self._ready = asyncio.Event()
        self._overflow = asyncio.Event()
        self.session: RealtimeSession | None = None

    async def run(self) -> str:
        """Serve the client until it leaves or something ends it; why, for the log."""
        reason = "the client left"
        try:
            self.session = await self._make_session(self._emit)
            await self.session.start()
            reason = await first_to_end(self._receive(), self._send(), self._watch())
        except SessionEnded as exc:
            reason = str(exc)
            await self._flush_and_close(aiohttp.WSCloseCode.POLICY_VIOLATION, reason)
        except (SessionError, MoshiError) as exc:  # the session cannot start (a bad voice)
            reason = one_line(exc)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._ws.send_str(json.dumps(error(reason, None, "session_failed")))
        except ConnectionError:
            reason = "the client left"
        finally:
            if self.session is not None:
                await self.session.close()
            await close_ended(self._ws)
        return self._ended(reason)

    def _emit(self, event: dict[str, Any]) -> None:
        text = json.dumps(event, separators=(",", ":"))
        self._outbox.append(text)
        self._unsent += len(text)
        self._ready.set()
        if self._unsent > MAX_UNSENT_BYTES:
            self._overflow.set()

    async def _receive(self) -> str:
        async for message in self._ws:
            if message.type == aiohttp.WSMsgType.ERROR:
                return broken_reason(self._ws, self._limits)
            if message.type != aiohttp.WSMsgType.TEXT:
                self._emit(error("send client events as JSON text messages", None, "bad_frame"))
                continue
            try:
                event = json_value(message.data, "the message")
            except BadBody as exc:
                self._emit(error(str(exc), None, "invalid_json"))
                continue
            if not isinstance(event, dict):
                self._emit(error("a client event is a JSON object", None, "invalid_event"))
                continue
            try:
                await self.session.handle(event)
            except Exception as exc:
                log.exception("realtime event %s failed", capped(event.get("type")))
                self._emit(error(f"the server failed: {one_line(exc)}", None, None, "server_error"))
        return "the client left"

    async def _send(self) -> None:
        while True:
            await self._ready.wait()
            while self._outbox:
                text = self._outbox.popleft()
                await self._ws.send_str(text)
                self._unsent -= len(text)
            self._ready.clear()

    async def _watch(self) -> str:
        await self._overflow.wait()
        raise SessionEnded(
            f"over {MAX_UNSENT_BYTES >> 20} MiB of events wait for the client; it does not read"
        )

    async def _flush_and_close(self, code: int, reason: str) -> None:
        self._outbox.clear()
        try:
            await asyncio.wait_for(
                self._ws.close(code=code, message=reason.encode()[:120]), timeout=2.0
            )
        except (asyncio.TimeoutError, ConnectionError, RuntimeError):
            pass
