"""A serve app of the tests behind the server's `ConnectionGuard` on a loopback port: on the
test's event loop (`start_guarded`), or on one in a thread of its own (`LoopbackServer`,
`served`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from aiohttp import web

from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import ConnectionGuard

MakeApp = Callable[[ConnectionGuard], web.Application]


def with_routes(add_routes: Callable, *args) -> MakeApp:
    """A `MakeApp`: an app with only the guard's middleware and `add_routes(app, *args)`."""

    def make(guard: ConnectionGuard) -> web.Application:
        app = web.Application(middlewares=[guard.middleware])
        add_routes(app, *args)
        return app

    return make


async def start_guarded(context: ServeContext, make_app: MakeApp) -> tuple[web.AppRunner, str]:
    """`make_app(guard)` behind a guard of `context`'s limits, listening on a free loopback
    port: (its runner, to clean up, and host:port)."""
    guard = ConnectionGuard(context.limits, context.tally)
    runner = guard.app_runner(make_app(guard), access_log=None)
    await runner.setup()
    await guard.site(runner, "127.0.0.1", 0).start()
    return runner, f"127.0.0.1:{runner.addresses[0][1]}"


class LoopbackServer:
    """`start_guarded` on an event loop in a thread of its own: `address` (host:port), `port`,
    `app`; `run` runs a coroutine on that loop; `close` stops the app and the loop."""

    def __init__(self, context: ServeContext, make_app: MakeApp):
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._loop_thread.start()
        self._runner, self.address = self.run(start_guarded(context, make_app), 30)
        self.port = self._runner.addresses[0][1]

    @property
    def app(self) -> web.Application:
        return self._runner.app

    def run(self, coroutine, timeout: float = 120):
        """The result of `coroutine`, run on the server's loop."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def close(self) -> None:
        self.run(self._runner.cleanup(), 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)


@contextlib.contextmanager
def served(context: ServeContext, make_app: MakeApp) -> Iterator[str]:
    """A `LoopbackServer` for the `with` block: yields its host:port."""
    server = LoopbackServer(context, make_app)
    try:
        yield server.address
    finally:
        server.close()
