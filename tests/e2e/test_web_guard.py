"""`moshi_mlx.serve.guard` around a small aiohttp app (no model): request and idle deadlines,
the connection cap, counted log records, closing connections that cannot flush, the
descriptor limit."""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.limits import Limits

GET = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


@asynccontextmanager
async def guarded(limits: Limits):
    """An app with `/` (text) and `/ws` (echo websocket) behind a `ConnectionGuard`; yields
    (port, guard, summary lines so far)."""

    async def page(_request):
        return web.Response(text="ok")

    async def echo(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            await ws.send_bytes(message.data)
        return ws

    summary = io.StringIO()
    logger = logging.getLogger(f"guard-test-{id(summary)}")
    logger.addHandler(logging.StreamHandler(summary))
    logger.propagate = False
    guard = ConnectionGuard(limits, EventTally(logger))
    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/", page)
    app.router.add_get("/ws", echo)
    runner = guard.app_runner(app, access_log=None)
    await runner.setup()
    await guard.site(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1], guard, summary
    finally:
        await runner.cleanup()


async def _closed_after(reader: asyncio.StreamReader, started: float, timeout: float) -> float:
    """Seconds from `started` until the server closed the connection (reading what it sent)."""
    while await asyncio.wait_for(reader.read(65536), timeout):
        pass
    return time.monotonic() - started


async def _get(port: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/") as response,
    ):
        return response.status


def test_requests_must_arrive_within_the_header_timeout():
    """Nothing sent, or headers one line at a time (slowloris): closed at the deadline."""

    async def scenario():
        async with guarded(Limits(header_timeout=1.0)) as (port, _guard, summary):
            started = time.monotonic()
            silent, _ = await asyncio.open_connection("127.0.0.1", port)
            trickling, trickle = await asyncio.open_connection("127.0.0.1", port)
            trickle.write(b"GET / HTTP/1.1\r\n")

            async def drip():
                for n in range(20):
                    await asyncio.sleep(0.3)
                    trickle.write(f"X-Line-{n}: slow\r\n".encode())

            dripping = asyncio.create_task(drip())
            closed = await asyncio.gather(
                _closed_after(silent, started, 5), _closed_after(trickling, started, 5)
            )
            dripping.cancel()
            status = await _get(port)  # a prompt request is served all the while
        return closed, status, summary.getvalue()

    closed, status, summary = asyncio.run(scenario())
    assert all(1.0 <= seconds < 3.0 for seconds in closed), closed
    assert status == 200
    assert "2 connections closed for sending no request within 1 s from 1 address" in summary


def test_idle_keep_alive_connections_close_after_the_idle_timeout():
    """After a response, the next request must come (complete) within the idle timeout."""

    async def scenario():
        async with guarded(Limits(idle_timeout=1.0, header_timeout=30.0)) as (port, _, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(GET)
            assert b"200 OK" in await reader.readuntil(b"ok")
            served = time.monotonic()
            writer.write(b"GET / HTTP/1.1\r\n")  # a second request that never completes
            return await _closed_after(reader, served, 5)

    assert 1.0 <= asyncio.run(scenario()) < 3.5


def test_at_the_cap_the_longest_idle_connection_makes_room():
    """30 idle connections against a cap of 10: a visitor is served, a websocket kept."""

    async def scenario():
        async with guarded(Limits(max_connections=10, header_timeout=60.0)) as (
            port,
            guard,
            summary,
        ):
            async with aiohttp.ClientSession() as session:
                ws = await session.ws_connect(f"http://127.0.0.1:{port}/ws")
                idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
                await asyncio.sleep(0.2)
                held = guard.open_connections
                status = await _get(port)
                await ws.send_bytes(b"still here")
                echoed = (await ws.receive(timeout=5)).data
                await ws.close()
            still_open = 0
            for reader, writer in idle:
                try:
                    still_open += await asyncio.wait_for(reader.read(1), 0.05) != b""
                except asyncio.TimeoutError:
                    still_open += 1
                writer.close()
        return held, status, echoed, still_open, summary.getvalue()

    held, status, echoed, still_open, summary = asyncio.run(scenario())
    assert held <= 10 and status == 200 and echoed == b"still here"
    assert 0 < still_open < 10, still_open  # the newest idle ones, the oldest made room
    assert "idle connections closed to make room (at most 10 connections)" in summary


def test_when_every_connection_is_busy_a_newcomer_is_refused_at_once():
    async def scenario():
        async with (
            guarded(Limits(max_connections=2)) as (port, _guard, summary),
            aiohttp.ClientSession() as session,
        ):
            busy = [await session.ws_connect(f"http://127.0.0.1:{port}/ws") for _ in "ab"]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            refused = await asyncio.wait_for(reader.read(), 2) == b""
            writer.close()
            for ws in busy:
                await ws.close()
        return refused, summary.getvalue()

    refused, summary = asyncio.run(scenario())
    assert refused and "1 connections refused (all 2 busy) from 1 address" in summary


def test_malformed_requests_are_counted_not_logged_with_tracebacks(caplog):
    async def scenario():
        async with guarded(Limits()) as (port, _guard, summary):
            for n in range(200):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nBad Header %d\r\n\r\n" % n)
                assert b"400 Bad Request" in await reader.read()
                writer.close()
        return summary.getvalue()

    with caplog.at_level(logging.INFO):
        summary = asyncio.run(scenario())
    (line,) = summary.strip().splitlines()
    assert line.startswith("200 malformed requests from 1 address in the last"), summary
    assert not [r for r in caplog.records if r.name == "aiohttp.server"], caplog.text[:2000]


def test_other_repeated_log_records_show_once_per_interval(caplog):
    tally = EventTally(logging.getLogger("guard-test-repeats"))
    tally.quiet_noisy_loggers()
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(50):
                logging.getLogger("asyncio").error("Unexpected trouble: %s", "details")
            tally.flush()
    finally:
        tally.restore_noisy_loggers()
    shown = [r.getMessage() for r in caplog.records]
    assert shown[0] == "Unexpected trouble: details"
    assert shown[1] == "49 more log messages like 'Unexpected trouble: %s' in the last 0 s"
    assert len(shown) == 2


def test_a_closing_connection_whose_peer_does_not_read_is_cut():
    """A peer that stops reading keeps a closed transport's buffer (and descriptor) forever
    unless someone aborts it."""

    async def scenario():
        async with guarded(Limits()) as (port, guard, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(GET)
            await reader.readuntil(b"ok")
            (transport,) = guard._connections
            transport.write(bytes(64 << 20))  # more than the kernel's buffers take
            transport.close()
            closed_at = time.monotonic()
            while guard.open_connections and time.monotonic() - closed_at < 10:
                await asyncio.sleep(0.05)
            writer.close()
            return time.monotonic() - closed_at

    assert asyncio.run(scenario()) < 4.0


def test_the_connection_cap_fits_the_descriptor_limit():
    """Soft = hard = 256: 192 connections (64 descriptors kept); a higher hard limit: the soft
    one is raised to fit the requested 256 connections."""
    probe = (
        "import resource, sys; from moshi_mlx.serve.limits import Limits, fit_to_descriptor_limit; "
        "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
        "limits, soft = fit_to_descriptor_limit(Limits()); "
        "print(limits.max_connections, soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )

    def run(soft: int, hard: int) -> list[str]:
        command = [sys.executable, "-c", probe, str(soft), str(hard)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()

    assert run(256, 256) == ["192", "256", "256"]
    assert run(256, 4096) == ["256", "320", "320"]


SERVE_AT_64_DESCRIPTORS = """
import asyncio, resource, sys
from test_web_guard import guarded
from moshi_mlx.serve.limits import Limits

async def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    async with guarded(Limits(max_connections=1000)) as (port, _guard, summary):
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(summary.getvalue(), flush=True)

asyncio.run(main())
"""


def test_out_of_descriptors_the_accept_loop_waits_and_counts():
    """A cap above the descriptor limit (as if other files took them): accepting fails with
    EMFILE; the guard counts it, retries each second and serves again once some close."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE_AT_64_DESCRIPTORS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent,
    )
    try:
        port = int(server.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        time.sleep(1.5)
        for client in clients[:60]:
            client.close()
        status = asyncio.run(asyncio.wait_for(_get(port), 10))
        for client in clients[60:]:
            client.close()
        out, err = server.communicate("stop\n", timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    assert status == 200
    assert "failed accepts (EMFILE)" in out, out
    assert "Traceback" not in err and len(err) < 1000, err
