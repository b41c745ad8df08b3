"""The speech-to-text server over real websockets, speaking msgpack as Kyutai's clients do
(`scripts/stt_from_*_rust_server.py`, unmute's `SpeechToText`), with fake streams."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import aiohttp
import msgpack
import numpy as np
import pytest
from served_app import LoopbackServer
from stt_fake import FAIL, FRAME_SIZE, LOUD, PAUSE_PROBABILITIES, STEP_SECONDS, FakeFactory

from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.stt.server import ASR_PATH, STT_WORKER, SttServerConfig, log


class Server(LoopbackServer):
    """`serve`'s app with the STT route over `factory`'s batches (warmed up by `warm_up`,
    when given, on the model thread), on a free localhost port, served by a loop on its own
    thread."""

    def __init__(self, factory, config: SttServerConfig, warm_up=None):
        self.factory = factory
        self.thread = ModelThread()
        self.thread.start()

        def rows(count: int):
            if warm_up is not None:
                warm_up()
            return factory(count)

        self.context = ServeContext(
            self.thread,
            EventTally(log),
            config.limits,
            api_keys=config.api_keys,
            max_streams=config.max_streams,
            max_buffered_seconds=config.max_buffered_seconds,
            loopback_only=config.loopback_only,
            stt_rows=rows,
        )
        super().__init__(self.context, lambda guard: create_app(self.context, guard))
        self.worker = self.app[STT_WORKER]
        self.url = f"ws://{self.address}{ASR_PATH}"

    def close(self) -> None:
        super().close()
        self.thread.stop()


@pytest.fixture
def serve():
    servers = []

    def start(config: SttServerConfig | None = None, warm_up=None, **fake_options) -> Server:
        server = Server(FakeFactory(**fake_options), config or SttServerConfig(), warm_up)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def audio(pcm) -> bytes:
    """An Audio message as Kyutai's clients pack it (float32 samples)."""
    return msgpack.packb({"type": "Audio", "pcm": [float(x) for x in pcm]}, use_single_float=True)


def frames(values) -> np.ndarray:
    """One frame per value, each filled with it."""
    return np.concatenate([np.full(FRAME_SIZE, v, np.float32) for v in values])


async def receive(ws, until, timeout: float = 10.0) -> list[dict]:
    """Messages until one satisfies `until` (included) or the connection closes."""
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        message = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
        if message.type != aiohttp.WSMsgType.BINARY:
            return messages
        messages.append(msgpack.unpackb(message.data))
        if until(messages[-1]):
            return messages


def is_step(n: int):
    return lambda message: message == {**message, "type": "Step", "step_idx": n}


def run(coroutine):
    return asyncio.run(coroutine)


def test_ready_then_steps_and_words_in_order_whatever_the_chunk_sizes(serve):
    server = serve()
    values = [(k + 1) / 1000 for k in range(25)]  # the last 2 steps have no words
    pcm = frames(values)
    cuts = np.cumsum(np.random.default_rng(0).integers(1, 5000, size=len(pcm) // 1000))
    chunks = np.split(pcm, cuts[cuts < len(pcm)])

    async def talk():
        async with aiohttp.ClientSession() as session:
            headers = {"kyutai-api-key": "public_token"}
            async with session.ws_connect(server.url, headers=headers) as ws:
                first = await receive(ws, until=lambda m: True)
                for chunk in chunks:
                    await ws.send_bytes(audio(chunk))
                return first + await receive(ws, until=is_step(len(values)))

    messages = run(talk())
    assert messages[0] == {"type": "Ready"}
    steps = [m for m in messages if m["type"] == "Step"]
    assert [m["step_idx"] for m in steps] == list(range(1, len(values) + 1))
    assert all(m["prs"] == pytest.approx(PAUSE_PROBABILITIES) for m in steps)
    assert all(0 <= m["buffered_pcm"] < len(pcm) for m in steps)
    assert steps[-1]["buffered_pcm"] == 0
    words = [(m["type"], m.get("text"), m.get("start_time", m.get("stop_time"))) for m in messages]
    words = [w for w in words if w[0] in ("Word", "EndWord")]
    expected = []
    for i in range(len(values)):
        if i % 5 == 0:
            expected.append(("Word", f"s{i}:{i + 1}", pytest.approx(i * STEP_SECONDS)))
        if i % 5 == 2:
            expected.append(("EndWord", None, pytest.approx(i * STEP_SECONDS)))
    assert words == expected
    # Kyutai's order within a step: Step first, then its words.
    assert messages.index(steps[5]) + 1 == messages.index(
        next(m for m in messages if m.get("text", "").startswith("s5:"))
    )
    factory = server.factory
    stepping = set().union(*(stream.threads for stream in factory.streams))
    assert stepping == factory.threads and len(stepping) == 1
    assert threading.get_ident() not in stepping


def test_marker_comes_back_after_the_audio_before_it_and_the_delay(serve):
    server = serve()  # the fake's words lag 2 steps

    async def talk():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url) as ws:
            await receive(ws, until=lambda m: m["type"] == "Ready")
            await ws.send_bytes(audio(frames([0.1] * 7)[:-1800]))  # 6 frames and 120 samples
            await ws.send_bytes(msgpack.packb({"type": "Marker", "id": 42}))
            await ws.send_bytes(audio(np.zeros(1800, np.float32)))
            for _ in range(6):
                await ws.send_bytes(audio(np.zeros(FRAME_SIZE, np.float32)))
                await asyncio.sleep(0.02)
            return await receive(ws, until=lambda m: m["type"] == "Marker")

    messages = run(talk())
    assert messages[-1] == {"type": "Marker", "id": 42}
    steps = [m["step_idx"] for m in messages if m["type"] == "Step"]
    assert steps == list(range(1, 9))  # 6 whole frames before it, then 2 steps of delay


def test_no_pause_heads_no_step_messages(serve):
    server = serve(heads=False)

    async def talk():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url) as ws:
            await ws.send_bytes(audio(frames([0.3] * 6)))
            await ws.send_bytes(msgpack.packb({"type": "Marker", "id": 1}))
            await ws.send_bytes(audio(frames([0.0] * 2)))
            return await receive(ws, until=lambda m: m["type"] == "Marker")

    messages = run(talk())
    assert [m["type"] for m in messages] == [
        "Ready",
        "Word",
        "EndWord",
        "Word",
        "EndWord",
        "Marker",
    ]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "not a msgpack message"),
        (msgpack.packb({"type": "Transcribe"}), "unknown message type 'Transcribe'"),
        (msgpack.packb({"type": "Audio", "pcm": ["0.1"]}), 'Audio "pcm" must hold only numbers'),
        (msgpack.packb({"type": "Audio", "pcm": [float("nan")]}), "NaN or infinity"),
        (msgpack.packb({"type": "Audio"}), 'Audio needs "pcm"'),
        (msgpack.packb({"type": "Marker", "id": 1.5}), 'Marker needs "id"'),
        (msgpack.packb({"type": "OggOpus", "data": b"OggS"}), "OggOpus audio is not supported"),
        (audio(np.zeros(300_000)), "at most 240000 samples"),
        ("hello", "text messages are not part of the protocol"),
    ],
    ids=[
        "not-msgpack",
        "unknown-type",
        "pcm-strings",
        "pcm-nan",
        "no-pcm",
        "bad-marker",
        "opus",
        "huge-audio",
        "text",
    ],
)
def test_a_bad_message_gets_a_one_line_error_and_the_connection_closes(serve, payload, reason):
    server = serve()

    async def talk():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url) as ws:
            await receive(ws, until=lambda m: m["type"] == "Ready")
            await ws.send_bytes(audio(frames([0.2])))
            if isinstance(payload, str):
                await ws.send_str(payload)
            else:
                await ws.send_bytes(payload)
            messages = await receive(ws, until=lambda m: m["type"] == "Error")
            closing = await ws.receive(timeout=5)
            return messages, closing.type

    messages, closing = run(talk())
    error = messages[-1]
    assert error["type"] == "Error" and reason in error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    assert closing in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)


def test_a_failing_model_step_ends_that_stream_with_a_one_line_error(serve):
    server = serve()

    async def talk():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url) as ws:
            await ws.send_bytes(audio(frames([0.2, FAIL])))
            return await receive(ws, until=lambda m: m["type"] == "Error")

    error = run(talk())[-1]
    assert error["message"] == "the model failed: the fake model fails on -0.5"
    _wait_for(lambda: server.worker.open_streams == 0)


def test_a_frozen_client_does_not_stall_another_and_is_dropped(serve, caplog):
    caplog.set_level(logging.INFO, logger="moshi_mlx.stt")
    server = serve(SttServerConfig(limits=Limits(client_silence_timeout=2.0)), word_every=1)

    async def talk():
        async with aiohttp.ClientSession() as session:
            frozen = await session.ws_connect(server.url)
            for _ in range(50):  # 50 s of words of 8 kB each, never read
                await frozen.send_bytes(audio(np.full(24_000, LOUD, np.float32)))
            await asyncio.sleep(0.5)
            started = time.monotonic()
            async with session.ws_connect(server.url) as ws:
                await ws.send_bytes(audio(frames([0.2] * 20)))
                messages = await receive(ws, until=lambda m: m.get("text") == "s19:200", timeout=5)
            elapsed = time.monotonic() - started
            while not any(
                "no pong" in r.message or "does not read" in r.message for r in caplog.records
            ):
                await asyncio.sleep(0.05)
            return messages, elapsed

    messages, elapsed = run(asyncio.wait_for(talk(), 10))
    assert [m["text"] for m in messages if m["type"] == "Word"] == [f"s{i}:200" for i in range(20)]
    assert elapsed < 3.0
    _wait_for(
        lambda: any("no pong" in r.message or "does not read" in r.message for r in caplog.records)
    )
    _wait_for(lambda: server.worker.open_streams == 0)


def test_a_client_that_sends_no_audio_is_told_why_and_dropped(serve):
    server = serve(SttServerConfig(limits=Limits(client_silence_timeout=1.0)))

    async def talk():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url) as ws:
            started = time.monotonic()
            messages = await receive(ws, until=lambda m: m["type"] == "Error")
            return messages, time.monotonic() - started

    messages, elapsed = run(talk())
    assert messages == [
        {"type": "Ready"},
        {"type": "Error", "message": "no audio from the client for 1 s"},
    ]
    assert elapsed < 3.0


def test_audio_waits_for_the_warm_up_and_a_flood_is_refused(serve):
    warmed = threading.Event()
    server = serve(SttServerConfig(max_buffered_seconds=1.0), warm_up=lambda: warmed.wait(10))

    async def talk():
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(server.url) as flood,
            session.ws_connect(server.url) as patient,
        ):
            await flood.send_bytes(audio(np.zeros(30_000, np.float32)))
            flooded = await receive(flood, until=lambda m: m["type"] == "Error")
            await patient.send_bytes(audio(frames([0.4])))
            with pytest.raises(asyncio.TimeoutError):
                await patient.receive(timeout=0.3)
            warmed.set()
            return flooded, await receive(patient, until=lambda m: m["type"] == "Word")

    flooded, patient = run(talk())
    assert flooded[-1]["message"].startswith("over 1 s of audio wait to be transcribed")
    assert [m["type"] for m in patient] == ["Ready", "Step", "Word"]


def test_busy_beyond_max_streams_and_a_freed_slot_is_reused(serve):
    server = serve(SttServerConfig(max_streams=1))

    async def talk():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url) as first:
                await receive(first, until=lambda m: m["type"] == "Ready")
                async with session.ws_connect(server.url) as second:
                    busy = await receive(second, until=lambda m: True)
            async with session.ws_connect(server.url) as third:
                return busy, await receive(third, until=lambda m: True)

    busy, ready = run(talk())
    assert busy == [{"type": "Error", "message": "busy: all 1 streams are in use; try again later"}]
    assert ready == [{"type": "Ready"}]


def test_api_keys_by_header_or_query(serve):
    server = serve(SttServerConfig(api_keys=frozenset({"secret"})))

    async def connect(url: str, headers: dict) -> int | list:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(url, headers=headers) as ws:
                    return await receive(ws, until=lambda m: True)
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    assert run(connect(server.url, {})) == 401
    assert run(connect(server.url, {"kyutai-api-key": "public_token"})) == 401
    assert run(connect(server.url, {"kyutai-api-key": "secret"})) == [{"type": "Ready"}]
    assert run(connect(server.url + "?auth_id=secret", {})) == [{"type": "Ready"}]


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ({}, True),
        ({"Origin": "http://127.0.0.1:{port}"}, True),
        ({"Origin": "http://evil.example"}, False),
        ({"Host": "evil.example:{port}"}, False),  # DNS rebinding onto a loopback server
    ],
    ids=["no-origin", "same-origin", "other-origin", "other-host"],
)
def test_browser_origin_and_loopback_host_checks(serve, headers, allowed):
    server = serve(SttServerConfig(loopback_only=True))
    headers = {name: value.format(port=server.port) for name, value in headers.items()}

    async def connect():
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(server.url, headers=headers) as ws:
                    return await receive(ws, until=lambda m: True)
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    assert run(connect()) == ([{"type": "Ready"}] if allowed else 403)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
