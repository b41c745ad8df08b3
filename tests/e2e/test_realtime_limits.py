"""`/v1/realtime` against bad input, through a raw websocket (aiohttp's client): malformed
JSON, events of unknown type, bad base64, audio in the wrong format, events out of order,
binary frames, an oversized message, a client that never reads. Each gets an `error` event
(or a close with a reason) and the session goes on to answer a text turn."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import pytest
from realtime_helpers import LOUD, MODELS, Parts, checked, pcm16, serving

from moshi_mlx.serve.realtime import connection
from moshi_mlx.serve.realtime.connection import MAX_MESSAGE_BYTES, RealtimeConnection


@pytest.fixture(scope="module")
def address():
    with serving(Parts()) as host_port:
        yield host_port


async def _next(ws, kind: str) -> dict:
    while True:
        message = await asyncio.wait_for(ws.receive(), 20)
        assert message.type == aiohttp.WSMsgType.TEXT, message
        event = checked(json.loads(message.data))
        if event["type"] == kind:
            return event


async def _error_for(ws, data) -> dict:
    if isinstance(data, bytes):
        await ws.send_bytes(data)
    else:
        await ws.send_str(data if isinstance(data, str) else json.dumps(data))
    return (await _next(ws, "error"))["error"]


def test_bad_events_get_errors_and_the_session_goes_on(address):
    bad_cases = [
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_event"),
        (b"\x00\x01binary", "bad_frame"),
        ({"type": "no.such.event"}, "unknown_event"),
        ({"type": "input_audio_buffer.append", "audio": "!!not base64!!"}, "invalid_value"),
        ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()},
         "invalid_value"),
        ({"type": "input_audio_buffer.append", "audio": 5}, "invalid_value"),
        ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
        ({"type": "response.cancel"}, "response_cancel_not_active"),
        ({"type": "conversation.item.truncate", "item_id": "x", "content_index": 0,
          "audio_end_ms": 10}, "invalid_value"),
        ({"type": "conversation.item.create", "item": {"type": "message", "role": "robot",
          "content": []}}, "invalid_value"),
        ({"type": "conversation.item.create", "item": {"type": "function_call"}},
         "unsupported_item"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/opus"}}}}}, "invalid_value"),
        ({"type": "session.update", "session": {"type": "transcription"}}, "invalid_value"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": {"type": "loudness"}}}}}, "invalid_value"),
        ({"type": "session.update", "session": {"type": "realtime", "audio": {
            "output": {"voice": "nobody"}}}}, None),
        ({"type": "conversation.item.delete", "item_id": "x"}, "unsupported_event"),
        ({"type": "response.create", "response": {"metadata": {"k": 5}}}, "invalid_value"),
        ({"type": "response.create", "response": {"metadata": {f"k{i}": "v" for i in range(17)}}},
         "invalid_value"),
    ]  # fmt: skip

    async def body():
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://{address}/v1/realtime?model={MODELS['llm']}") as ws,
        ):
            await _next(ws, "session.created")
            for data, code in bad_cases:
                error = await _error_for(ws, data)
                assert error["message"] and (code is None or error["code"] == code), (data, error)
                if isinstance(data, dict) and data["type"] == "session.update":
                    assert error["param"].startswith("session"), error
            # the client's own event id comes back with its error
            error = await _error_for(ws, {"type": "response.cancel", "event_id": "evt_mine"})
            assert error["event_id"] == "evt_mine"
            # the session still converses
            await ws.send_str(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Hi"}]}}))  # fmt: skip
            await ws.send_str(json.dumps({"type": "response.create"}))
            done = await _next(ws, "response.done")
            assert done["response"]["status"] == "completed"

    asyncio.run(body())


def test_an_oversized_message_closes_with_a_reason(address):
    async def body():
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://{address}/v1/realtime", max_msg_size=0) as ws,
        ):
            await _next(ws, "session.created")
            audio = "A" * (MAX_MESSAGE_BYTES + 10)
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            message = await asyncio.wait_for(ws.receive(), 20)
            while message.type == aiohttp.WSMsgType.TEXT:
                message = await asyncio.wait_for(ws.receive(), 20)
            assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        # the server goes on: a new session works
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://{address}/v1/realtime") as ws,
        ):
            await _next(ws, "session.created")
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": pcm16([LOUD] * 3)}))  # fmt: skip
            await _next(ws, "input_audio_buffer.speech_started")

    asyncio.run(body())


def test_an_unknown_model_is_refused_at_the_handshake(address):
    async def body():
        url = f"http://{address}/v1/realtime?model=nope"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == "model_not_found"

    asyncio.run(body())


class _StuckSocket:
    """A websocket whose client never reads: sends never finish; nothing comes in."""

    def __init__(self):
        self.closed_with: tuple | None = None
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()

    async def send_str(self, _text: str) -> None:
        await asyncio.Event().wait()

    async def close(self, code: int = 1000, message: bytes = b"") -> None:
        self.closed_with, self.closed = (code, message), True


class _ChattySession:
    """A session that emits 64 KiB events forever."""

    def __init__(self, emit):
        self._emit = emit
        self.closed = False

    async def start(self) -> None:
        async def chatter():
            while True:
                self._emit({"type": "response.output_audio.delta", "delta": "A" * 65536})
                await asyncio.sleep(0)

        self._task = asyncio.create_task(chatter())

    async def close(self) -> None:
        self.closed = True
        self._task.cancel()


def test_a_client_that_never_reads_is_closed_with_a_reason(monkeypatch):
    monkeypatch.setattr(connection, "MAX_UNSENT_BYTES", 1 << 20)
    ws = _StuckSocket()
    sessions = []

    async def make_session(emit):
        sessions.append(_ChattySession(emit))
        return sessions[-1]

    async def body():
        from moshi_mlx.serve.limits import Limits

        return await asyncio.wait_for(RealtimeConnection(ws, make_session, Limits()).run(), 10)

    reason = asyncio.run(body())
    assert "does not read" in reason
    assert ws.closed_with[0] == aiohttp.WSCloseCode.POLICY_VIOLATION
    assert b"does not read" in ws.closed_with[1] and sessions[0].closed


def test_dropped_mic_audio_is_counted_and_logged_sparingly(caplog):
    from moshi_mlx.realtime.dropped import DroppedAudio

    dropped = DroppedAudio("sess_x")
    with caplog.at_level("WARNING", logger="moshi_mlx.realtime"):
        for _ in range(100):  # a client far ahead of real time
            dropped.add(80)
    assert dropped.ms == 8000
    assert len(caplog.records) == 1 and "80 ms of mic audio dropped" in caplog.text
