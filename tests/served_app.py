"""A serve app of the tests behind the server's `ConnectionGuard` on a loopback port, on the
test's event loop (`start_guarded`) or on one in a thread of its own (`served`)."""

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


@contextlib.contextmanager
def served(context: ServeContext, make_app: MakeApp) -> Iterator[str]:
    """`start_guarded` on an event loop in a thread of its own: yields host:port, then stops
    the app and the loop."""
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    runner, address = asyncio.run_coroutine_threadsafe(
        start_guarded(context, make_app), loop
    ).result(10)
    try:
        yield address
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
