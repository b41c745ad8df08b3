"""What keeps a server usable when its clients vanish, stall or misbehave; no chat protocol.

- `ConnectionGuard` accepts connections itself (`GuardedSite`): it never holds more than
  `Limits.max_connections` (`limits.py`) (so the process never runs out of file descriptors), makes room
  for a newcomer by closing the longest-idle connection, and closes connections whose first
  request is not in within `Limits.header_timeout`. aiohttp closes idle keep-alive
  connections after `Limits.idle_timeout` (`ConnectionGuard.app_runner`).
- `EventTally` counts repeated events (refused connections, malformed requests, transport
  errors that aiohttp and asyncio would log with a traceback each) and logs one line per kind
  and interval.

Websocket sessions (liveness, caps, closing) are in `sessions.py`.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from moshi_mlx.errors import ConfigError
from moshi_mlx.serve.limits import Limits

# A connection that is closing but cannot flush (its peer stopped reading) is cut after this.
CLOSING_GRACE_SECONDS = 2.0
# How long a websocket close handshake (or a last message before it) may take.
CLOSE_SECONDS = 2.0
SUMMARY_SECONDS = 10.0
_RETRY_ACCEPT_SECONDS = 1.0
_MAX_COUNTED_ADDRESSES = 10_000
# Loggers that would write a line (often a traceback) per malformed request or lost peer.
_NOISY_LOGGERS = ("aiohttp.server", "asyncio")

log = logging.getLogger("moshi_mlx.serve.chat")


class EventTally:
    """Counts events by kind and logs one line per kind and interval instead of one per event.

    `quiet_noisy_loggers` routes aiohttp's and asyncio's per-request error records here too.
    """

    def __init__(self, logger: logging.Logger, interval: float = SUMMARY_SECONDS):
        self._log = logger
        self.interval = interval
        self._events: dict[str, int] = {}
        self._addresses: dict[str, set[str]] = {}
        self._shown: set[str] = set()
        self._since = time.monotonic()
        self._filter = _TallyFilter(self)

    def count(self, kind: str, address: str | None = None) -> None:
        """One more event of `kind` (a plural noun phrase: "malformed requests")."""
        self._events[kind] = self._events.get(kind, 0) + 1
        addresses = self._addresses.setdefault(kind, set())
        if address is not None and len(addresses) < _MAX_COUNTED_ADDRESSES:
            addresses.add(address)

    def first(self, kind: str) -> bool:
        """True for the first event of `kind` since the last summary (the caller shows that
        one); later ones are counted."""
        if kind in self._shown:
            self.count(kind)
            return False
        self._shown.add(kind)
        return True

    def flush(self) -> None:
        """Log the summary lines of the events counted since the last one, and start over."""
        seconds = time.monotonic() - self._since
        for kind, events in self._events.items():
            addresses = len(self._addresses[kind])
            origin = ""
            if addresses:
                more = "+" if addresses >= _MAX_COUNTED_ADDRESSES else ""
                origin = f" from {addresses}{more} address{'es' if addresses > 1 else ''}"
            self._log.warning("%d %s%s in the last %.0f s", events, kind, origin, seconds)
        self._events.clear()
        self._addresses.clear()
        self._shown.clear()
        self._since = time.monotonic()

    async def run(self) -> None:
        """Flush every `interval` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.flush()

    def quiet_noisy_loggers(self) -> None:
        """Count, instead of logging each, aiohttp's malformed requests and asyncio's transport
        errors; other records of those loggers show once per kind and interval."""
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)

    def restore_noisy_loggers(self) -> None:
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)


class _TallyFilter(logging.Filter):
    def __init__(self, tally: EventTally):
        super().__init__()
        self._tally = tally

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            # aiohttp's "Error handling request from %s": the client's bytes were not HTTP.
            args = record.args if isinstance(record.args, tuple) else ()
            self._tally.count("malformed requests", str(args[0]) if args else None)
            return False
        if isinstance(error, OSError):
            self._tally.count(f"connection errors ({type(error).__name__})")
            return False
        first_line = next(iter(str(record.msg).splitlines()), "")
        return self._tally.first(f"more log messages like {first_line!r}")


class _GuardedConnection(asyncio.Protocol):
    """One accepted connection: the server's own protocol inside, what the guard needs outside."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol, address: str):
        self._guard = guard
        self._inner = inner
        self.address = address
        self.transport: asyncio.BaseTransport | None = None
        self.opened_at = 0.0
        self.requests = 0  # requests that reached the application
        self.handling = 0  # requests in the application's handlers now
        self.closing_since: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.opened_at = time.monotonic()
        self._guard._connections[transport] = self  # the newest is the last to be evicted
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard._connections.pop(self.transport, None)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ConnectionGuard:
    """Accepts a server's connections within `limits` and counts what it refuses in `tally`.

    Serve an application with `app_runner`, `middleware` (first in the app's middlewares) and
    `site`; `open_connections` says how many connections are held now.
    """

    def __init__(self, limits: Limits, tally: EventTally):
        self.limits = limits
        self.tally = tally
        # Longest idle first: a request's end moves its connection to the back.
        self._connections: dict[asyncio.BaseTransport, _GuardedConnection] = {}
        self._handshaking = 0  # accepted sockets in their TLS handshake
        self._tasks: set[asyncio.Task] = set()

    @property
    def open_connections(self) -> int:
        return len(self._connections) + self._handshaking

    def app_runner(self, app: web.Application, **options) -> web.AppRunner:
        """aiohttp's runner for `app`, closing keep-alive connections after `idle_timeout`."""
        return web.AppRunner(app, keepalive_timeout=self.limits.idle_timeout, **options)

    def site(
        self,
        runner: web.AppRunner,
        host: str | None,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> GuardedSite:
        """A site of `runner` on `host`:`port` whose connections this guard accepts."""
        return GuardedSite(runner, self, host, port, ssl_context)

    async def serve(
        self,
        app: web.Application,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> web.AppRunner:
        """Serve `app` on `host`:`port` through this guard; the started runner (clean it up to
        stop), or a one-line `ConfigError` when the address cannot be listened on."""
        runner = self.app_runner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await self.site(runner, host, port, ssl_context).start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        return runner

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Marks a connection busy while its request is handled (busy ones are never evicted)."""
        connection = self._connections.get(request.transport)
        if connection is None:  # closed meanwhile, or served by an unguarded site
            return await handler(request)
        connection.requests += 1
        connection.handling += 1
        try:
            return await handler(request)
        finally:
            connection.handling -= 1
            if self._connections.pop(connection.transport, None) is not None:
                self._connections[connection.transport] = connection

    async def _start(
        self,
        protocol_factory: Callable[[], asyncio.Protocol],
        host: str | None,
        port: int,
        ssl_context: ssl.SSLContext | None,
    ) -> list[socket.socket]:
        listeners = await _listen(host, port)
        for listener in listeners:
            self._spawn(self._accept(listener, protocol_factory, ssl_context))
        self._spawn(self._sweep())
        self._spawn(self.tally.run())
        self.tally.quiet_noisy_loggers()
        return listeners

    async def _stop(self) -> None:
        """Stop accepting (the site closes the listening sockets) and log the last summary."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.tally.flush()
        self.tally.restore_noisy_loggers()

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(
        self,
        listener: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except ConnectionError:  # the peer gave up before we accepted
                continue
            except OSError as exc:  # out of descriptors or memory after all: wait, count
                self.tally.count(f"failed accepts ({errno.errorcode.get(exc.errno, exc)})")
                await asyncio.sleep(_RETRY_ACCEPT_SECONDS)
                continue
            peer = str(address[0])
            if self.open_connections >= self.limits.max_connections and not self._evict():
                sock.close()
                self.tally.count(
                    f"connections refused (all {self.limits.max_connections} busy)", peer
                )
            else:
                self._spawn(self._connect(sock, peer, protocol_factory, ssl_context))
            await asyncio.sleep(0)  # let evicted connections close before the next accept

    def _evict(self) -> bool:
        """Close the longest-idle connection not in a handler; False if there is none."""
        for transport, connection in self._connections.items():
            if connection.handling == 0 and not transport.is_closing():
                del self._connections[transport]
                transport.abort()
                self.tally.count(
                    f"idle connections closed to make room (at most "
                    f"{self.limits.max_connections} connections)",
                    connection.address,
                )
                return True
        return False

    async def _connect(
        self,
        sock: socket.socket,
        peer: str,
        protocol_factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._handshaking += 1
        try:
            await loop.connect_accepted_socket(
                lambda: _GuardedConnection(self, protocol_factory(), peer),
                sock,
                ssl=ssl_context,
                ssl_handshake_timeout=self.limits.header_timeout if ssl_context else None,
            )
        except (OSError, asyncio.TimeoutError):  # asyncio closed the socket
            self.tally.count("failed TLS handshakes" if ssl_context else "failed setups", peer)
        finally:
            self._handshaking -= 1

    async def _sweep(self) -> None:
        """Close connections whose first request is late, and cut closing ones that hang."""
        deadline = self.limits.header_timeout
        interval = min(1.0, deadline / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for transport, connection in list(self._connections.items()):
                if transport.is_closing():
                    connection.closing_since = connection.closing_since or now
                    if now - connection.closing_since >= CLOSING_GRACE_SECONDS:
                        transport.abort()
                elif connection.requests == 0 and now - connection.opened_at >= deadline:
                    transport.abort()
                    self.tally.count(
                        f"connections closed for sending no request within {deadline:g} s",
                        connection.address,
                    )


class GuardedSite(web.BaseSite):
    """An aiohttp site like `web.TCPSite` whose connections a `ConnectionGuard` accepts."""

    def __init__(
        self,
        runner: web.AppRunner,
        guard: ConnectionGuard,
        host: str | None,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
    ):
        super().__init__(runner, ssl_context=ssl_context)
        self._guard = guard
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        listeners = await self._guard._start(
            self._runner.server, self._host, self._port, self._ssl_context
        )
        self._server = _Listeners(listeners)

    async def stop(self) -> None:
        if self._server is not None:
            await self._guard._stop()
        await super().stop()


class _Listeners:
    """The listening sockets, shaped as aiohttp's `BaseRunner.addresses` reads a site's server."""

    def __init__(self, sockets: list[socket.socket]):
        self.sockets = sockets

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


async def _listen(host: str | None, port: int) -> list[socket.socket]:
    """Listening sockets on every address of `host` (all interfaces for None), as asyncio's
    `create_server` makes them; `OSError` if one cannot be bound."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this machine lacks (IPv6 off)
                continue
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)
            sock.setblocking(False)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners
