"""`/api/chat` of `python -m moshi_mlx serve --moshi` (and its `web` preset) on a tiny random
checkpoint, through Python websocket clients: Kyutai's protocol, equality with the offline
API, bad inputs, busy, disconnects, origin, static files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import numpy as np
import pytest
from tiny_moshi import (
    cached_tiny_moshi,
    cached_tiny_personaplex,
    espeak_speech,
    load_tiny_model,
    tiny_moshi_command,
)
from web_harness import (
    FRAME,
    Reply,
    ServerThread,
    decode_ogg,
    free_port,
    has_handshake,
    ogg_pages,
    read_until,
)

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.persona.cache import CACHE_ENV
from moshi_mlx.chat.persona.role import EXAMPLE_ROLES
from moshi_mlx.cli.serve import ssl_context
from moshi_mlx.errors import ConfigError, WeightsError
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.persona import MAX_ROLE_CHARS
from moshi_mlx.serve.chat.protocol import Kind
from moshi_mlx.serve.chat.service import ChatSettings
from moshi_mlx.serve.limits import Limits

NO_LAG = 10**6  # frames: the equality test must not drop any


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cached_tiny_moshi(tmp_path_factory)


@pytest.fixture(scope="module")
def server(files):
    running = ServerThread(lambda: load_tiny_model(files))
    service = running.service
    assert service.ready.wait(120) and service.error is None, service.error
    yield running
    running.close()


def test_the_warm_up_compiles_the_servers_sampling(files):
    """The step the server's sessions use by default is compiled before `ready`."""
    sampling = Sampling(0.5, 25), Sampling(0.8, 10)
    running = ServerThread(lambda: load_tiny_model(files), ChatSettings(sampling=sampling))
    service = running.service
    try:
        assert service.ready.wait(120) and service.error is None, service.error
        compiled = service.model.compiled_steps.choices()
        assert compiled == [(*sampling, None, 1.0)]  # no KV quantization, no guidance
    finally:
        running.close()


@pytest.fixture(scope="module")
def url(server):
    # These clients send their audio at once and then wait, where a live one keeps streaming.
    patient = Limits(client_silence_timeout=120.0)
    port = server.serve(ChatSettings(max_lag_frames=NO_LAG), patient)
    return f"ws://127.0.0.1:{port}/api/chat"


def _speech(tmp_path, seconds: float) -> np.ndarray:
    """espeak-ng speech read from a wav (a two-tone signal where espeak is missing)."""
    wav = espeak_speech(tmp_path / "speech.wav", "hello moshi how are you today")
    if wav is not None:
        pcm = read_audio(wav)
    else:
        t = np.arange(int(seconds * 24000)) / 24000
        pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 2 * t)).astype(np.float32)
    return np.resize(pcm, int(seconds * 24000)).astype(np.float32)


def _talk(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


def test_seeded_conversation_equals_the_offline_api(files, url, tmp_path, monkeypatch):
    """Text and Moshi's codes through the server equal `MoshiModel` on the decoded input."""
    codes_by_thread: dict[str, list] = {}
    real_step = ChatStepper.step

    def recording_step(self, user_codes):
        out = real_step(self, user_codes)
        if out.frame is not None:
            name = threading.current_thread().name
            codes_by_thread.setdefault(name, []).append(np.array(out.frame))
        return out

    monkeypatch.setattr(ChatStepper, "step", recording_step)
    pages = ogg_pages(_speech(tmp_path, 2.0))
    query = "?text_seed=7&audio_seed=9&text_temperature=0.9&audio_topk=100&pad_mult=0"

    async def converse():
        async with aiohttp.ClientSession() as session, session.ws_connect(url + query) as ws:
            reply = await read_until(ws, Reply(), has_handshake)
            for page in pages:
                await ws.send_bytes(protocol.audio(page))
            n_frames = len(decode_ogg(pages)) // FRAME
            await read_until(ws, reply, lambda r: len(decode_ogg(r.audio)) >= n_frames * FRAME)
            # The last step's text follows its audio; a ping says nothing more is coming.
            return await read_until(ws, reply, lambda r: r.messages[-1][0] == Kind.PING)

    reply = _talk(converse())
    served_codes = codes_by_thread.pop("moshi-mlx-model")
    info = json.loads(reply.of_kind(Kind.METADATA)[0])
    assert info["seed"] == 7 and info["text_temperature"] == 0.9 and info["audio_topk"] == 100

    # Offline: the same bytes decoded by the same library, stepped by the embedding API.
    user = decode_ogg(pages)
    offline_model = load_tiny_model(files)
    sampling = Sampling(0.9, 25), Sampling(0.8, 100)
    with offline_model.conversation(*sampling, seed=7) as conversation:
        steps = [
            conversation.step(user[i : i + FRAME]) for i in range(0, len(user) - FRAME + 1, FRAME)
        ]
    offline_codes = codes_by_thread.pop(threading.current_thread().name)
    assert reply.text == "".join(step.text for step in steps)
    assert len(served_codes) == len(offline_codes) > 0
    np.testing.assert_array_equal(np.stack(served_codes), np.stack(offline_codes))
    heard = decode_ogg(reply.audio)
    assert len(heard) == len(steps) * FRAME and np.abs(heard).max() > 1e-3


def test_handshake_is_kyutais_and_pings_keep_an_idle_connection_alive(url):
    async def idle():
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            return await read_until(ws, Reply(), lambda r: len(r.of_kind(Kind.PING)) >= 2, 5)

    reply = _talk(idle())
    assert reply.messages[0] == bytes([0]) + bytes(8)  # kind 0, version 0 and model 0 as u32
    assert reply.of_kind(Kind.METADATA) and not reply.error


BAD_INPUTS = {
    "oversized": (lambda ws: ws.send_bytes(protocol.audio(bytes(100_000))), "over the limit"),
    "text message": (lambda ws: ws.send_str("hello"), "text messages are not part"),
    "unknown kind": (lambda ws: ws.send_bytes(b"\x09abc"), "unknown message kind 0x09"),
    "empty message": (lambda ws: ws.send_bytes(b""), "empty message"),
    "undecodable opus": (
        lambda ws: ws.send_bytes(protocol.audio(b"this is not an ogg stream" * 4)),
        "undecodable Ogg Opus",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_ends_that_connection_with_a_reason(url, name):
    send, reason = BAD_INPUTS[name]

    async def bad_then_good():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url) as ws:
                await read_until(ws, Reply(), has_handshake)
                await send(ws)
                bad = await read_until(ws, Reply(), lambda r: False)
            async with session.ws_connect(url) as ws:  # the server lives on
                good = await read_until(ws, Reply(), has_handshake)
        return bad, good

    bad, good = _talk(bad_then_good())
    assert bad.closed and reason in (bad.error or ""), bad.messages
    assert has_handshake(good)


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("text_temperature=warm", "text_temperature must be a number"),
        ("audio_topk=-3", "audio_topk must be a whole number"),
        ("text_seed=1.5", "text_seed must be a whole number"),
    ],
)
def test_bad_query_parameter_is_refused(url, query, reason):
    async def connect():
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{url}?{query}") as ws:
            return await read_until(ws, Reply(), lambda r: False)

    reply = _talk(connect())
    assert reply.closed and reason in reply.error and not has_handshake(reply)


def test_second_connection_is_busy_and_a_disconnect_frees_the_conversation(server, url, tmp_path):
    pages = ogg_pages(_speech(tmp_path, 1.6))
    freed_after = []

    async def scenario():
        async with aiohttp.ClientSession() as session:
            first = await session.ws_connect(url)
            await read_until(first, Reply(), has_handshake)
            async with session.ws_connect(url) as second:
                busy = await read_until(second, Reply(), lambda r: False)
            for page in pages:
                await first.send_bytes(protocol.audio(page))
            await read_until(first, Reply(), lambda r: len(r.audio) >= 3)
            await first.close()  # mid-conversation: frames are still queued for the model
            left = time.monotonic()
            while server.service.open_conversations:  # at most the step under way finishes
                await asyncio.sleep(0.01)
            freed_after.append(time.monotonic() - left)
            async with session.ws_connect(url) as third:
                reply = await read_until(third, Reply(), has_handshake)
                for page in pages[:4]:
                    await third.send_bytes(protocol.audio(page))
                await read_until(third, reply, lambda r: len(r.audio) >= 3)
        return busy, reply

    busy, reply = _talk(scenario())
    assert busy.closed and busy.error.startswith("busy"), busy.messages
    assert not has_handshake(busy)
    assert has_handshake(reply) and not reply.error
    assert freed_after[0] < 1.0, freed_after  # a tiny step takes ~0.1-0.3 s here


def test_lagging_model_drops_oldest_audio_and_tells_the_client(server, tmp_path):
    port = server.serve(ChatSettings(max_lag_frames=1))
    pages = ogg_pages(_speech(tmp_path, 2.4))

    async def flood():
        chat = f"ws://127.0.0.1:{port}/api/chat"
        async with aiohttp.ClientSession() as session, session.ws_connect(chat) as ws:
            await read_until(ws, Reply(), has_handshake)
            for page in pages:  # 30 frames at once: far more than the model does in time
                await ws.send_bytes(protocol.audio(page))
            return await read_until(ws, Reply(), _lag_notices)

    reply = _talk(flood())
    lag = _lag_notices(reply)[0]
    assert lag["dropped_frames"] > 0 and lag["total_dropped"] >= lag["dropped_frames"]
    assert len(reply.audio) < len(pages)


def _lag_notices(reply: Reply) -> list[dict]:
    notices = [json.loads(m) for m in reply.of_kind(Kind.METADATA)]
    return [notice["lag"] for notice in notices if "lag" in notice]


def _server_of_a_failing_load(gate: threading.Event) -> ServerThread:
    """A server whose chat model's load waits for `gate`, then fails."""

    def slow_failing_load():
        gate.wait(30)
        raise WeightsError("no weights here")

    return ServerThread(slow_failing_load)


def test_pings_while_the_model_loads_then_a_load_failure_is_reported():
    gate = threading.Event()
    running = _server_of_a_failing_load(gate)
    port = running.serve()

    async def connect():
        chat = f"ws://127.0.0.1:{port}/api/chat"
        async with aiohttp.ClientSession() as session, session.ws_connect(chat) as ws:
            reply = await read_until(ws, Reply(), lambda r: len(r.of_kind(Kind.PING)) >= 2)
            gate.set()
            return await read_until(ws, reply, lambda r: False)

    try:
        reply = _talk(connect())
    finally:
        gate.set()
        running.close()
    assert reply.closed and "could not load the model" in reply.error
    assert not has_handshake(reply)


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        (None, True),
        ("http://127.0.0.1:{port}", True),
        ("http://evil.example", False),
        ("http://127.0.0.1:1", False),
        ("null", False),
    ],
)
def test_browser_websockets_must_come_from_this_server(url, origin, allowed):
    port = url.split(":")[2].split("/")[0]
    headers = {} if origin is None else {"Origin": origin.format(port=port)}

    async def connect():
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(url, headers=headers) as ws:
                    return has_handshake(await read_until(ws, Reply(), has_handshake))
            except aiohttp.WSServerHandshakeError as exc:
                assert exc.status == 403
                return False

    assert _talk(connect()) is allowed


def test_static_files_only_from_the_page_folder(server, tmp_path):
    static = tmp_path / "dist"
    (static / "assets").mkdir(parents=True)
    (static / "index.html").write_text("<p>their client</p>")
    (static / "assets" / "app.js").write_text("// js")
    (tmp_path / "secret.txt").write_text("do not serve")
    ours = server.serve()
    theirs = server.serve(ChatSettings(static_dir=static))

    async def fetch(port, path):
        page = f"http://127.0.0.1:{port}{path}"
        async with aiohttp.ClientSession() as session, session.get(page) as response:
            return response.status, await response.text()

    def get(port, path):
        return _talk(fetch(port, path))

    status, page = get(ours, "/")
    assert status == 200 and "Moshi" in page and "app.js" in page
    for name in ("app.js", "voice-link.js", "ogg.js", "audio-worklet.js", "style.css"):
        assert get(ours, f"/{name}")[0] == 200
    assert get(theirs, "/") == (200, "<p>their client</p>")
    assert get(theirs, "/assets/app.js")[0] == 200
    for path in (
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/assets/../../secret.txt",
        "/..%2fsecret.txt",
        "/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    ):
        status, body = get(theirs, path)
        assert status in (403, 404) and "do not serve" not in body, path


def test_static_symlinks_are_served_only_when_they_point_inside_the_folder(server, tmp_path):
    static = tmp_path / "dist"
    static.mkdir()
    (static / "app.js").write_text("// js")
    (static / "alias.js").symlink_to(static / "app.js")
    (tmp_path / "secret.txt").write_text("do not serve")
    (static / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (static / "index.html").symlink_to(tmp_path / "secret.txt")
    port = server.serve(ChatSettings(static_dir=static))

    async def fetch(path):
        page = f"http://127.0.0.1:{port}{path}"
        async with aiohttp.ClientSession() as session, session.get(page) as response:
            return response.status, await response.text()

    assert _talk(fetch("/alias.js")) == (200, "// js")
    for path in ("/leak.txt", "/", "/index.html"):
        status, body = _talk(fetch(path))
        assert status == 404 and "do not serve" not in body, path


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_https_and_wss_with_a_self_signed_pair(server, tmp_path):
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(tmp_path / "key.pem"),
            "-out",
            str(tmp_path / "cert.pem"),
        ],
        check=True,
        capture_output=True,
    )
    port = server.serve(ssl_context=ssl_context(str(tmp_path)))

    async def connect():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{port}/", ssl=False) as response:
                page = await response.text()
            async with session.ws_connect(f"wss://127.0.0.1:{port}/api/chat", ssl=False) as ws:
                return page, await read_until(ws, Reply(), has_handshake)

    page, reply = _talk(connect())
    assert "Moshi" in page and has_handshake(reply)


@contextlib.contextmanager
def _local_web(files, tmp_path, *flags, descriptors: int | None = None):
    """`python -m moshi_mlx web` on 127.0.0.1 (with `descriptors` as its `ulimit -n`), once
    ready; yields (process, port, log path)."""
    port = free_port()
    log = tmp_path / "server.log"
    command = tiny_moshi_command(
        "moshi_mlx web", files, "--host", "127.0.0.1", "--port", port, "--no-browser", *flags
    )
    if descriptors is not None:
        command = ["prlimit", f"--nofile={descriptors}:{descriptors}", *command]
    with open(log, "wb") as out:
        command = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "ready: " not in log.read_text():
            assert command.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield command, port, log
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_mid_conversation_ends_the_command_promptly(files, tmp_path, stop):
    """SIGTERM (launchd's and systemd's way to stop a service) acts as Ctrl-C: the client's
    websocket is closed with 1001 (going away), the command says so and exits 130."""
    pages = ogg_pages(_speech(tmp_path, 3.0))
    with _local_web(files, tmp_path) as (command, port, log):

        async def talk_then_interrupt():
            url = f"ws://127.0.0.1:{port}/api/chat"
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                reply = await read_until(ws, Reply(), has_handshake)
                for page in pages:  # at the pace of speech, so no audio is dropped for lag
                    await ws.send_bytes(protocol.audio(page))
                    await asyncio.sleep(0.08)  # one page holds 80 ms
                await read_until(ws, reply, lambda r: len(r.audio) >= 2)
                interrupted = time.monotonic()
                command.send_signal(stop)  # while steps are queued or running
                exited = asyncio.get_running_loop().run_in_executor(None, command.wait, 30)
                await asyncio.gather(read_until(ws, reply, lambda r: False), exited)
                return time.monotonic() - interrupted, reply.closed, ws.close_code

        seconds, closed, close_code = _talk(talk_then_interrupt())
    output = log.read_text()
    assert command.returncode == 130 and "interrupted" in output, output
    assert "Traceback" not in output and seconds < 3.0, (seconds, output)
    assert closed and close_code == aiohttp.WSCloseCode.GOING_AWAY, close_code
    assert "conversation ended: the server is stopping" in output, output
    if stop == signal.SIGTERM:
        assert "SIGTERM: stopping as on Ctrl-C" in output


def test_with_an_api_key_the_chat_and_persona_need_it(server):
    """`serve --moshi --api-key K`: Kyutai's header or `?auth_id=` (our page passes its own
    address's on), else 401; the page's files stay open."""
    port = server.serve(api_keys=frozenset({"secret"}))

    async def statuses():
        base = f"127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            codes = []
            for path in ("/", "/api/persona", "/api/persona?auth_id=secret"):
                async with session.get(f"http://{base}{path}") as response:
                    codes.append(response.status)
            try:
                await session.ws_connect(f"ws://{base}/api/chat")
            except aiohttp.WSServerHandshakeError as exc:
                codes.append(exc.status)
            headers = {"kyutai-api-key": "secret"}
            async with session.ws_connect(f"ws://{base}/api/chat", headers=headers) as ws:
                codes.append(has_handshake(await read_until(ws, Reply(), has_handshake)))
            async with session.ws_connect(f"ws://{base}/api/chat?auth_id=secret") as ws:
                codes.append(has_handshake(await read_until(ws, Reply(), has_handshake)))
            return codes

    assert _talk(statuses()) == [200, 401, 200, 401, True, True]


def test_a_loopback_server_answers_only_loopback_names(server):
    """A page whose domain was re-pointed at 127.0.0.1 (DNS rebinding) gets nothing."""
    port = server.serve(loopback_only=True)

    async def status(host: str, path: str) -> int:
        headers = {"Host": host.format(port=port)}
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
        ):
            return response.status

    async def statuses():
        return [
            await status(host, path)
            for host in (
                "localhost:{port}",
                "127.0.0.1:{port}",
                "[::1]:{port}",
                "127.0.0.2:{port}",  # any loopback address, as `--host` accepts
                "evil.example:{port}",
            )
            for path in ("/", "/api/chat")
        ]

    # /api/chat without an upgrade is a 400 from the websocket handshake, i.e. it was reached.
    assert _talk(statuses()) == [200, 400, 200, 400, 200, 400, 200, 400, 403, 403]


# --- liveness: a client that vanished or froze must not hold the conversation ---------------
TALKER = Path(__file__).parents[1] / "helpers" / "web_talker.py"
HANDSHAKE_REQUEST = (
    "GET /api/chat HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _masked_frame(payload: bytes) -> bytes:
    """A binary websocket frame as a client must send it (masked), payload under 64 KiB."""
    mask = os.urandom(4)
    length = (
        bytes([0x80 | len(payload)])
        if len(payload) < 126
        else b"\xfe" + len(payload).to_bytes(2, "big")
    )
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return b"\x82" + length + mask + masked


def _next_visitor_converses(url: str, timeout: float = 20.0) -> float:
    """Connect again and again (a busy server says so within about a second) until a
    conversation starts; returns when that was (time.monotonic())."""

    async def visit():
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                async with session.ws_connect(url) as ws:
                    reply = await read_until(ws, Reply(), has_handshake)
                    if has_handshake(reply):
                        return time.monotonic()
        raise AssertionError("no conversation for the next visitor")

    return _talk(visit())


def _ended(caplog, after: float) -> list[tuple[float, str]]:
    """(time.time(), message) of the "conversation ended" lines logged after `after`."""
    return [
        (record.created, record.getMessage())
        for record in caplog.records
        if "conversation ended" in record.getMessage() and record.created > after
    ]


def _wait_for_line(process: subprocess.Popen, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        assert line or process.poll() is None, "the client ended"
    raise AssertionError(f"no {text!r} from the client")


def _lose_a_talker(caplog, url: str, lose, command_prefix=()) -> tuple[float, float, str]:
    """Start `web_talker.py` on `url`, `lose()` it mid-conversation; returns (seconds until the
    server logged the conversation's end, seconds until the next visitor conversed, reason)."""
    caplog.set_level(logging.INFO, logger="moshi_mlx.serve.chat")
    talker = subprocess.Popen(
        [*command_prefix, sys.executable, str(TALKER), url], stdout=subprocess.PIPE, text=True
    )
    try:
        _wait_for_line(talker, "talking")
        time.sleep(0.5)
        lost_wall, lost = time.time(), time.monotonic()
        lose(talker)
        conversed = _next_visitor_converses(url) - lost
        (ended, reason), *_ = _ended(caplog, lost_wall)
    finally:
        talker.kill()
        talker.wait()
    return ended - lost_wall, conversed, reason


@pytest.fixture(scope="module")
def live_url(server):
    port = server.serve()  # the default limits
    return f"ws://127.0.0.1:{port}/api/chat"


def test_a_frozen_client_is_dropped_and_the_next_visitor_served(live_url, caplog):
    """SIGSTOP: its kernel still acknowledges our packets, it answers nothing."""
    detected, conversed, reason = _lose_a_talker(
        caplog, live_url, lambda talker: talker.send_signal(signal.SIGSTOP)
    )
    print(f"\nfrozen client: dropped after {detected:.1f} s, next visitor in {conversed:.1f} s")
    assert "no pong" in reason and detected < 5.0 and conversed < 10.0, (detected, reason)


def test_a_client_that_stops_reading_and_answering_is_dropped(server, live_url, caplog):
    """What a half-open peer looks like to the server: the handshake, audio, then nothing."""
    caplog.set_level(logging.INFO, logger="moshi_mlx.serve.chat")
    host = live_url.split("/")[2]
    pages = ogg_pages(np.zeros(FRAME * 10, np.float32))
    with socket.create_connection(tuple(host.split(":"))) as peer:
        peer.sendall(HANDSHAKE_REQUEST.format(host=host).encode())
        assert b"101 Switching Protocols" in peer.recv(1024)
        for page in pages:
            peer.sendall(_masked_frame(protocol.audio(page)))
            time.sleep(0.08)
        lost_wall, lost = time.time(), time.monotonic()  # from now on: silence, no reads
        conversed = _next_visitor_converses(live_url) - lost
    (ended, reason), *_ = _ended(caplog, lost_wall)
    print(
        f"\nsilent peer: dropped after {ended - lost_wall:.1f} s, next visitor in {conversed:.1f} s"
    )
    assert "no pong" in reason and ended - lost_wall < 5.0 and conversed < 10.0, reason


def _namespace_missing_reason() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    name = f"moshi-probe-{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot make a network namespace: {probe.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", name], check=False)
    return None


@pytest.fixture
def namespace():
    """A network namespace joined to ours by a veth pair: (name, our address, its link)."""
    reason = _namespace_missing_reason()
    if reason:
        pytest.skip(reason)
    name, ours, theirs = f"moshi-{os.getpid()}", f"mh{os.getpid()}", f"mc{os.getpid()}"
    subnet = f"10.213.{os.getpid() % 250}"

    def ip(*args, inside=False):
        prefix = ["ip", "netns", "exec", name] if inside else []
        subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)

    ip("netns", "add", name)
    try:
        ip("link", "add", ours, "type", "veth", "peer", "name", theirs)
        ip("link", "set", theirs, "netns", name)
        ip("addr", "add", f"{subnet}.1/24", "dev", ours)
        ip("link", "set", ours, "up")
        ip("addr", "add", f"{subnet}.2/24", "dev", theirs, inside=True)
        ip("link", "set", theirs, "up", inside=True)
        ip("link", "set", "lo", "up", inside=True)
        yield name, f"{subnet}.1", lambda: ip("link", "set", theirs, "down", inside=True)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)  # takes the veth pair along


def test_a_client_whose_network_vanishes_is_dropped(server, namespace, caplog):
    """A real half-open connection: the client's link goes down without a FIN or RST."""
    name, address, pull_the_cable = namespace
    port = server.serve(host=address)
    url = f"ws://{address}:{port}/api/chat"
    detected, conversed, reason = _lose_a_talker(
        caplog, url, lambda _talker: pull_the_cable(), ("ip", "netns", "exec", name)
    )
    print(f"\nhalf-open client: dropped after {detected:.1f} s, next visitor in {conversed:.1f} s")
    assert "no pong" in reason and detected < 5.0 and conversed < 10.0, (detected, reason)


def test_a_client_that_answers_pings_but_sends_no_audio_is_told_why(server):
    port = server.serve(limits=Limits(client_silence_timeout=1.0))

    async def silent():
        url = f"ws://127.0.0.1:{port}/api/chat"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            return await read_until(ws, Reply(), lambda r: False, 10)

    started = time.monotonic()
    reply = _talk(silent())
    assert reply.closed and reply.error == "no audio from the client for 1 s", reply.error
    assert time.monotonic() - started < 4.0


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_under_ulimit_256_hundreds_of_idle_connections_and_a_flood_leave_room_and_a_small_log(
    files, tmp_path
):
    """300 idle connections (held: a long --header-timeout), then 1000 malformed requests and
    300 more connections, against a server whose descriptor limit is 256: a visitor still
    gets the page and a conversation, the log stays a few summary lines."""
    # The visitor sends a few frames only: the silence watchdog must not end its conversation
    # before a loaded machine has answered them (liveness has tests of its own).
    flags = ("--header-timeout", "60", "--client-silence-timeout", "60")
    with _local_web(files, tmp_path, *flags, descriptors=256) as (command, port, log):
        assert "at most 192 connections" in log.read_text()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        time.sleep(0.5)
        descriptors = len(os.listdir(f"/proc/{command.pid}/fd"))

        async def visit():
            base = f"127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                started = time.monotonic()
                async with session.get(f"http://{base}/") as response:
                    page = response.status, time.monotonic() - started
                async with session.ws_connect(f"ws://{base}/api/chat") as ws:
                    reply = await read_until(ws, Reply(), has_handshake, 10)
                    # At the pace of speech: frames sent at once while the server is busy
                    # accepting the idle ones are (rightly) dropped for lag.
                    for page_bytes in ogg_pages(np.zeros(FRAME * 12, np.float32)):
                        await ws.send_bytes(protocol.audio(page_bytes))
                        await asyncio.sleep(0.08)
                    await read_until(ws, reply, lambda r: len(r.audio) >= 2, 20)
            return page, reply

        (status, seconds), reply = _talk(visit())
        held = sum(_still_open(sock) for sock in idle)

        async def flood():
            for n in range(1000):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET / HTTP/1.1\r\nBad Header %d\r\n\r\n" % n)
                await reader.read()
                writer.close()

        _talk(flood())
        idle += [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        time.sleep(0.5)
        command.send_signal(signal.SIGTERM)
        command.wait(30)
        for sock in idle:
            sock.close()
    output = log.read_text()
    print(
        f"\nulimit -n 256: {held} of 300 idle connections held while GET / took {seconds:.3f} s "
        f"and a conversation ran; {descriptors} descriptors open; log {len(output)} bytes:\n"
        + output
    )
    assert status == 200 and has_handshake(reply) and len(reply.audio) >= 2
    assert 150 < held < 192 and descriptors < 256, (held, descriptors)
    # The summaries come every 10 s: on a busy machine the flood spans two of them.
    malformed = re.findall(r"(\d+) malformed requests from 1 address", output)
    assert sum(map(int, malformed)) == 1000, output
    assert "idle connections closed to make room (at most 192 connections)" in output
    assert "Traceback" not in output and len(output) < 4000, output
    assert command.returncode == 130


def _still_open(sock: socket.socket) -> bool:
    """The server has not closed `sock` (nothing to read, no end of stream)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionError:
        return False


# --- PersonaPlex: /api/persona, voice_prompt and text_prompt ---------------------------------
@pytest.fixture(scope="module")
def persona_server(tmp_path_factory):
    """A server of the tiny PersonaPlex model (voices NATF2 and NATM1) whose default role is
    a file's (`--role @file`); the prompt cache in a fresh folder."""
    files = cached_tiny_personaplex(tmp_path_factory)
    folder = tmp_path_factory.mktemp("persona_server")
    (folder / "role.txt").write_text("You are a tutor.")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder / "prompts"))
        settings = ChatSettings(role=f"@{folder / 'role.txt'}")
        running = ServerThread(lambda: load_tiny_model(files), settings)
        service = running.service
        assert service.ready.wait(120) and service.error is None, service.error
        port = running.serve()
        yield running, port
        running.close()


def _get_json(port: int, path: str, status: int = 200) -> dict:
    async def fetch():
        page = f"http://127.0.0.1:{port}{path}"
        async with aiohttp.ClientSession() as session, session.get(page) as response:
            assert response.status == status
            return await response.json()

    return _talk(fetch())


def _connect(port: int, query: str) -> Reply:
    async def connect():
        chat = f"ws://127.0.0.1:{port}/api/chat?{query}"
        async with aiohttp.ClientSession() as session, session.ws_connect(chat) as ws:
            return await read_until(ws, Reply(), lambda r: has_handshake(r) or r.closed)

    return _talk(connect())


def test_the_persona_endpoint(server, persona_server):
    _, port = persona_server
    assert _get_json(port, "/api/persona") == {
        "prompted": True,
        "voices": ["NATF2", "NATM1"],
        "default_voice": "NATF2",
        "default_role": "You are a tutor.",
        "example_roles": list(EXAMPLE_ROLES),
        "max_role_chars": MAX_ROLE_CHARS,
    }
    moshi_port = server.serve()
    assert _get_json(moshi_port, "/api/persona") == {"prompted": False, "voices": []}


def test_the_persona_endpoint_while_the_model_loads_and_after_a_failure():
    gate = threading.Event()
    running = _server_of_a_failing_load(gate)
    service = running.service
    try:
        port = running.serve()
        assert _get_json(port, "/api/persona", 503) == {"loading": True}
        gate.set()
        assert service.ready.wait(10)
        assert "could not load" in _get_json(port, "/api/persona", 503)["error"]
    finally:
        gate.set()
        running.close()


def test_a_client_chooses_a_published_voice_and_a_role(persona_server, monkeypatch):
    running, port = persona_server
    model = running.service.model
    chosen = []
    conversation = model.conversation

    def recording(*args, **kwargs):
        chosen.append((kwargs["voice"], kwargs["role"]))
        return conversation(*args, **kwargs)

    monkeypatch.setattr(model, "conversation", recording)
    role = "You sell bicycles. Be brief."
    for query in (
        f"voice_prompt=NATM1.pt&text_prompt={quote(role)}",  # NVIDIA's client
        "voice_prompt=NATM1",
        "text_prompt=",
        "",
    ):
        reply = _connect(port, query)
        assert has_handshake(reply) and not reply.error, (query, reply.error)
    role_file = running.service.settings.role
    assert chosen == [("NATM1", role), ("NATM1", role_file), (None, ""), (None, role_file)]


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("voice_prompt=../x", "voice_prompt must name a voice (NATF2, NATM1), got '../x'"),
        ("voice_prompt=/etc/passwd", "voice_prompt must name a voice"),
        ("voice_prompt=NATF2/../../x", "voice_prompt must name a voice"),
        ("voice_prompt=%2E%2E%2Fx.pt", "voice_prompt must name a voice"),
        ("voice_prompt=NOPE.pt", "voice_prompt must name a voice (NATF2, NATM1), got 'NOPE.pt'"),
        (f"text_prompt={'x' * (MAX_ROLE_CHARS + 1)}", "the limit is 2000"),
        ("text_prompt=a%0Ab", "control characters"),
        ("text_prompt=%40role.txt", "may not start with @"),
    ],
)
def test_a_bad_persona_is_refused(persona_server, query, reason):
    reply = _connect(persona_server[1], query)
    assert reply.closed and reason in (reply.error or ""), reply.messages
    assert not has_handshake(reply)


def test_moshi_refuses_a_persona(url):
    port = int(url.split(":")[2].split("/")[0])
    reply = _connect(port, "voice_prompt=NATF2.pt&text_prompt=hi")
    assert reply.closed and "this server's model is Moshi" in reply.error
    assert not has_handshake(reply)


def test_a_voice_flag_for_moshi_stops_the_server(files):
    running = ServerThread(lambda: load_tiny_model(files), ChatSettings(voice="NATF2"))
    try:
        assert running.service.ready.wait(120)
        error = running.service.error
        assert isinstance(error, ConfigError) and "this model is Moshi" in str(error)
    finally:
        running.close()
