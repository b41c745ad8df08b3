"""`python -m moshi_mlx serve`'s live streams batched: two `/api/tts_streaming` clients, and
three `/api/asr-streaming` clients, joining at different times, each get exactly what they
get alone (greedy), in one compiled step per frame for all of them (tiny random STT and TTS
checkpoints, the tiny Mimi)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
from served_app import LoopbackServer
from tiny_moshi import cached_tiny_stt, load_tiny_stt, load_tiny_tts

from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.stt.server import ASR_PATH, STT_WORKER
from moshi_mlx.serve.tts.server import TTS_PATH, TTS_STREAMS
from moshi_mlx.tts.voices import voice_file_name

TTS_FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
ALICE = TTS_FIXTURES / "voices" / "alice.safetensors"
VOICE = "alice.wav"  # ALICE's name in the server's voice folder
FRAME = 1920
FLUSH_FRAMES = 10  # silence after a client's marker: its words come out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = cached_tiny_stt(tmp_path_factory)
    thread = ModelThread()
    thread.start()
    context = ServeContext(
        thread, EventTally(logging.getLogger("test")), max_streams=3, max_tts_streams=2
    )

    context.stt = thread.call_soon(lambda: load_tiny_stt(files)).result(300)
    context.tts = thread.call_soon(lambda: load_tiny_tts(files["mimi"])).result(300)
    voices = tmp_path_factory.mktemp("voices")
    shutil.copy(ALICE, voices / voice_file_name(VOICE, context.tts.config))
    context.voice_repo = str(voices)
    server = LoopbackServer(context, lambda guard: create_app(context, guard))
    server.run(_ready(server))
    yield server
    server.close()
    thread.stop()


async def _ready(server: LoopbackServer) -> None:
    """Until the STT worker is warm (its batch's step compiled)."""
    while not server.app[STT_WORKER].ready.is_set():
        await asyncio.sleep(0.05)


# --- TTS ---------------------------------------------------------------------------------


async def speak(
    address: str, words: list[str], started: asyncio.Event | None = None
) -> tuple[list[np.ndarray], list[tuple]]:
    """The words in one Text, then Eos, greedy; (audio frames, word timings). `started` is
    set once 3 frames came. One Text: the stream has all its words from its first step (a
    stream of a batch whose next word has not come reads padding, as Kyutai's server does,
    so words sent one by one would make the comparison depend on the machine's timing)."""
    url = f"ws://{address}{TTS_PATH}?voice={VOICE}&temperature=0"
    frames, spoken = [], []
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        assert msgpack.unpackb((await ws.receive(timeout=10)).data) == {"type": "Ready"}
        await ws.send_bytes(msgpack.packb({"type": "Text", "text": " ".join(words)}))
        await ws.send_bytes(msgpack.packb({"type": "Eos"}))
        async for message in ws:
            data = msgpack.unpackb(message.data)
            if data["type"] == "Audio":
                frames.append(np.array(data["pcm"], np.float32))
                if started is not None and len(frames) == 3:
                    started.set()
            elif data["type"] == "Text":
                spoken.append((data["text"], data["start_s"], data["stop_s"]))
            else:
                raise AssertionError(f"unexpected {data}")
    return frames, spoken


def _same_speech(together, alone) -> None:
    frames, words = together
    frames_alone, words_alone = alone
    assert len(frames) == len(frames_alone) and frames
    np.testing.assert_allclose(np.stack(frames), np.stack(frames_alone), rtol=0, atol=1e-6)
    assert words == words_alone and words


def test_two_tts_streams_one_joining_later_speak_as_alone(server):
    first = ["Hello", "there,", "this", "is", "the", "first", "stream."]
    second = ["And", "a", "second", "one."]
    streams = server.app[TTS_STREAMS]
    alone = [asyncio.run(speak(server.address, words)) for words in (first, second)]
    steps_alone = streams.batch_steps

    async def together():
        started = asyncio.Event()
        one = asyncio.create_task(speak(server.address, first, started))
        await started.wait()  # the second joins a batch under way
        return await asyncio.gather(one, speak(server.address, second))

    both = asyncio.run(together())
    steps_together = streams.batch_steps - steps_alone
    for ours, theirs in zip(both, alone):
        _same_speech(ours, theirs)
    # One compiled step per frame for both: fewer steps than the streams alone took.
    assert steps_together < steps_alone
    # Every stream left its batch (the model thread may still be taking the last one out).
    deadline = time.monotonic() + 2.0
    while streams.open_streams and time.monotonic() < deadline:
        time.sleep(0.01)
    assert streams.open_streams == 0


# --- STT ---------------------------------------------------------------------------------


async def transcribe(
    address: str, pcm: np.ndarray, joined: asyncio.Event, started: asyncio.Event | None = None
) -> list[dict]:
    """Once `joined` is set: the audio, a marker and silence after it (as Kyutai's clients
    send), all at once; the messages up to the marker. `started` is set after the 4th Step."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"ws://{address}{ASR_PATH}") as ws,
    ):
        assert msgpack.unpackb((await ws.receive(timeout=10)).data) == {"type": "Ready"}
        await joined.wait()
        for chunk in (pcm, None, np.zeros(FLUSH_FRAMES * FRAME, np.float32)):
            if chunk is None:
                await ws.send_bytes(msgpack.packb({"type": "Marker", "id": 7}))
            else:
                packed = {"type": "Audio", "pcm": chunk.tolist()}
                await ws.send_bytes(msgpack.packb(packed, use_single_float=True))
        messages = []
        while True:
            message = await ws.receive(timeout=30)
            assert message.type == aiohttp.WSMsgType.BINARY, (message, messages[-3:])
            data = msgpack.unpackb(message.data)
            messages.append(data)
            if started is not None and sum(m["type"] == "Step" for m in messages) == 4:
                started.set()
            if data["type"] == "Marker":
                return messages


def _same_transcript(together: list[dict], alone: list[dict]) -> None:
    assert [m["type"] for m in together] == [m["type"] for m in alone]
    for ours, theirs in zip(together, alone):
        if ours["type"] == "Step":
            assert ours["step_idx"] == theirs["step_idx"]
            np.testing.assert_allclose(ours["prs"], theirs["prs"], atol=1e-4)
        else:
            assert ours == pytest.approx(theirs)


def test_three_stt_streams_joining_at_different_times_transcribe_as_alone(server, mimi_signal):
    audio = [mimi_signal(frames * FRAME, seed) for frames, seed in ((30, 1), (24, 2), (18, 3))]
    worker = server.app[STT_WORKER]

    async def alone(pcm: np.ndarray) -> list[dict]:
        joined = asyncio.Event()
        joined.set()
        return await transcribe(server.address, pcm, joined)

    alone_messages = [asyncio.run(alone(pcm)) for pcm in audio]
    steps_alone = worker.batch_steps

    async def together():
        now = asyncio.Event()
        now.set()
        second, third = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(
            transcribe(server.address, audio[0], now, started=second),
            transcribe(server.address, audio[1], second, started=third),
            transcribe(server.address, audio[2], third),
        )

    together_messages = asyncio.run(together())
    steps_together = worker.batch_steps - steps_alone
    for ours, theirs in zip(together_messages, alone_messages):
        _same_transcript(ours, theirs)
    assert any(m["type"] == "Word" for messages in alone_messages for m in messages)
    # One compiled step per frame for all three: the streams overlap, so the batch took
    # about as many steps as the longest stream, not their sum.
    stream_steps = [sum(m["type"] == "Step" for m in messages) for messages in alone_messages]
    assert steps_together < sum(stream_steps) * 0.75, (steps_together, stream_steps)
