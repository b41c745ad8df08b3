"""A websocket route's sessions, on top of the connection guard; no protocol.

- `live_websocket` and `SilenceWatchdog` notice a websocket peer that froze or vanished;
  `broken_reason` says why one broke.
- `Sessions` caps a websocket route's sessions and runs, logs and (at shutdown,
  `StoppableConnection.stop`) stops each; `BinaryMessages` reads a session's client messages;
  `first_to_end` races a session's tasks (the client's
  messages, the model's results, watchdogs); `send_and_close` and `close_ended` end one.
- `stop_on_sigterm` makes SIGTERM (how launchd and systemd stop a service) act as Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import aiohttp
from aiohttp import web

from moshi_mlx.serve.guard import CLOSE_SECONDS, EventTally, log
from moshi_mlx.serve.limits import Limits

# How long a newcomer waits for a session slot being freed (a client reconnecting at once).
SLOT_GRACE_SECONDS = 1.0
# Sessions shorter than this are summarised by the tally, not logged one by one.
CHURN_SECONDS = 1.0


def live_websocket(limits: Limits, **options) -> web.WebSocketResponse:
    """A websocket response that pings a peer silent for half of `client_silence_timeout` and
    drops it without a pong within a quarter: a frozen or vanished peer goes within 3/4 of it."""
    return web.WebSocketResponse(
        heartbeat=limits.client_silence_timeout / 2, timeout=CLOSE_SECONDS, **options
    )


class SilenceWatchdog:
    """`ended()` returns once `heard()` was not called for `timeout` seconds."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._last = time.monotonic()

    def heard(self) -> None:
        self._last = time.monotonic()

    async def ended(self) -> str:
        """Wait, from now, until nothing is heard for `timeout` seconds; returns the reason
        that ends the session, for the client."""
        self.heard()
        while (left := self._last + self.timeout - time.monotonic()) > 0:
            await asyncio.sleep(left)
        return f"no audio from the client for {self.timeout:g} s"


def stop_on_sigterm() -> None:
    """Make SIGTERM do what Ctrl-C does now. Call on the main thread inside `asyncio.run`
    (whose Ctrl-C handler cancels the main task, then raises `KeyboardInterrupt`)."""
    on_interrupt = signal.getsignal(signal.SIGINT)
    if not callable(on_interrupt):  # Ctrl-C ignored (a background job): stop all the same
        on_interrupt = signal.default_int_handler

    def on_terminate(signum, frame) -> None:
        log.info("SIGTERM: stopping as on Ctrl-C")
        on_interrupt(signal.SIGINT, frame)

    signal.signal(signal.SIGTERM, on_terminate)


class SessionSlots:
    """At most `limit` sessions (conversations, streams) at once: `take` waits up to
    `SLOT_GRACE_SECONDS` for a slot being freed, `release` frees one."""

    def __init__(self, limit: int):
        self.limit = limit
        self._active = 0
        self._changed = asyncio.Condition()

    async def take(self) -> bool:
        """A slot, or False if none is freed within the grace."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._active < self.limit), SLOT_GRACE_SECONDS
                )
            except asyncio.TimeoutError:
                return False
            self._active += 1
            return True

    @property
    def active(self) -> int:
        """Slots taken now."""
        return self._active

    async def release(self) -> None:
        async with self._changed:
            self._active -= 1
            self._changed.notify_all()


class LiveConnection(Protocol):
    """One websocket's session, run by `Sessions`."""

    async def run(self) -> str:
        """Serve the client until the session ends; why it ended, for the log."""
        ...

    async def stop(self) -> None:
        """End the session: the server is shutting down."""
        ...


class StoppableConnection:
    """The part of a `LiveConnection` every route shares: `stop` closes its websocket with
    1001 (going away), after which `_ended` gives "the server is stopping" as the reason."""

    def __init__(self, ws: web.WebSocketResponse):
        self._ws = ws
        self._stopping = False

    async def stop(self) -> None:
        """Close with 1001 (going away): the server is shutting down."""
        self._stopping = True
        await close_going_away(self._ws)

    def _ended(self, reason: str) -> str:
        """Why the session ended, for the log: `reason`, unless the server stopped it."""
        return "the server is stopping" if self._stopping else reason


class Sessions:
    """The sessions of one websocket route (`noun`: "conversation", "stream"): at most `limit`
    at once (`SessionSlots`), each logged as it starts and ends, all stopped by `close_all`."""

    def __init__(self, limit: int, tally: EventTally, logger: logging.Logger, noun: str):
        self.slots = SessionSlots(limit)
        self._tally = tally
        self._log = logger
        self._noun = noun
        self._running: set[LiveConnection] = set()

    async def run(
        self,
        peer: str | None,
        start: Callable[[], LiveConnection],
        refuse: Callable[[], Awaitable[None]],
    ) -> None:
        """Run the session `start` makes once a slot is free; without one, `refuse` (tell the
        client the server is busy)."""
        if not await self.slots.take():
            self._tally.count("websockets told the server is busy", peer)
            await refuse()
            return
        connection = start()
        self._running.add(connection)
        reason = "the server stopped"
        # A session logs its start once it has lasted CHURN_SECONDS; shorter ones (a churn of
        # clients that open and close at once) are counted by the tally instead.
        started = asyncio.get_running_loop().call_later(
            CHURN_SECONDS, self._log.info, "%s: %s started", peer, self._noun
        )
        began = time.monotonic()
        try:
            reason = await connection.run()
        finally:
            self._running.discard(connection)
            await self.slots.release()
            started.cancel()
            if time.monotonic() - began < CHURN_SECONDS:
                self._tally.count(f"{self._noun}s that opened and closed at once", peer)
            else:
                self._log.info("%s: %s ended: %s", peer, self._noun, reason)

    @property
    def active(self) -> int:
        """Sessions running now."""
        return self.slots.active

    async def close_all(self, _app: web.Application) -> None:
        """Server shutdown: stop every session (its websocket closes with 1001)."""
        await asyncio.gather(*(connection.stop() for connection in self._running))


async def first_to_end(*work: Awaitable[str]) -> str:
    """Run `work` (coroutines or tasks) until the first ends: its result, or its exception;
    the others are cancelled (also when the caller is)."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for task in tasks:
            task.cancel()


async def send_and_close(ws: web.WebSocketResponse, message: bytes) -> None:
    """Send a last message (the protocol's error) and close; a client that left or stopped
    reading is fine (a close that cannot finish leaves the transport to the guard, which
    cuts it)."""
    with contextlib.suppress(ConnectionError, RuntimeError, asyncio.TimeoutError):
        await asyncio.wait_for(ws.send_bytes(message), CLOSE_SECONDS)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(ws.close(), CLOSE_SECONDS)


async def close_going_away(ws: web.WebSocketResponse) -> None:
    """Close with 1001 (going away): the server is shutting down."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(
            ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"server stopping"),
            CLOSE_SECONDS,
        )


async def close_ended(ws: web.WebSocketResponse) -> None:
    """Close the websocket of a session that ended without an error, unless the client did."""
    if not ws.closed:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ws.close(), CLOSE_SECONDS)


class BinaryMessages:
    """The data of a websocket's binary messages, as `async for` gives them, until the client
    leaves or the connection breaks; `ended` then says which, for the log. A message of another
    type raises `not_binary` (the protocol's error) with its type's name and `hint`."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        limits: Limits,
        not_binary: Callable[[str], Exception],
        hint: str,
    ):
        self._ws = ws
        self._limits = limits
        self._not_binary = not_binary
        self._hint = hint
        self.ended = ""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for message in self._ws:
            if message.type == aiohttp.WSMsgType.ERROR:
                self.ended = broken_reason(self._ws, self._limits)
                return
            if message.type != aiohttp.WSMsgType.BINARY:
                raise self._not_binary(
                    f"{message.type.name.lower()} messages are not part of the protocol; "
                    f"{self._hint}"
                )
            yield message.data
        self.ended = "the client left"


def broken_reason(ws: web.WebSocketResponse, limits: Limits) -> str:
    """Why reading a `live_websocket` gave an ERROR message, for the log: the heartbeat's
    missed pong, or the connection's failure."""
    if isinstance(ws.exception(), asyncio.TimeoutError):
        return (
            f"no pong within {limits.client_silence_timeout / 4:g} s of a ping "
            "(the client froze or its network went away)"
        )
    return f"the connection failed: {ws.exception()}"
