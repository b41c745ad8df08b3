"""`/v1/realtime` with Moshi full duplex (`serve --moshi`): the tiny random Moshi behind
`serve`'s app (tests/helpers/web_harness.py), through the `openai` package's realtime client. One mic
frame in, one reply frame out as an audio delta of the one long response, in order; the time
from each frame sent to its reply received is printed."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import pytest
from realtime_helpers import connected
from tiny_moshi import cached_tiny_moshi, load_tiny_model
from web_harness import ServerThread

from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.serve.chat.service import ChatSettings

FRAMES = 12


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    server = ServerThread(lambda: load_tiny_model(files))
    assert server.service.ready.wait(300) and server.service.error is None
    port = server.serve(ChatSettings(max_lag_frames=100))  # a slow CPU drops no frame
    yield f"127.0.0.1:{port}"
    server.close()


def test_moshi_replies_frame_by_frame_in_one_response(address):
    rng = np.random.default_rng(0)
    frames = [(0.1 * rng.standard_normal(FRAME_SIZE)).astype(np.float32) for _ in range(FRAMES)]

    async def body():
        async with connected(address, model="moshi", key="unused") as (connection, events):
            assert events.all[0]["session"]["audio"]["input"]["turn_detection"] is None
            sent = []
            for frame in frames:
                data = (frame * 32767).astype("<i2").tobytes()
                sent.append(time.monotonic())
                await connection.input_audio_buffer.append(audio=base64.b64encode(data).decode())
                await asyncio.sleep(FRAME_SIZE / 24000)
            received = []
            after = 0
            while len(received) < FRAMES:
                after = await events.wait("response.output_audio.delta", after) + 1
                received.append(time.monotonic())
            deltas = [e for e in events.all if e["type"] == "response.output_audio.delta"]
            assert len({e["response_id"] for e in deltas}) == 1
            assert all(len(base64.b64decode(e["delta"])) == 2 * FRAME_SIZE for e in deltas)
            await connection.response.cancel()
            done = events.all[await events.wait("response.done")]["response"]
            assert done["status"] == "cancelled"
            return [1000 * (r - s) for s, r in zip(sent, received, strict=True)]

    latencies = asyncio.run(asyncio.wait_for(body(), 120))
    print(
        f"mic frame -> reply frame: median {np.median(latencies):.0f} ms, max {max(latencies):.0f} ms"
    )


@pytest.fixture(scope="module")
def persona_address(tmp_path_factory):
    from tiny_moshi import cached_tiny_personaplex

    from moshi_mlx.chat.persona.cache import CACHE_ENV

    files = cached_tiny_personaplex(tmp_path_factory)
    folder = tmp_path_factory.mktemp("realtime_persona")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder / "prompts"))
        server = ServerThread(lambda: load_tiny_model(files))
        assert server.service.ready.wait(300) and server.service.error is None
        port = server.serve(ChatSettings(max_lag_frames=100))
        yield f"127.0.0.1:{port}"
        server.close()


def test_personaplex_takes_its_persona_from_voice_and_instructions(persona_address):
    """The tiny PersonaPlex: a published voice and a role from `session.update` start the
    conversation; a voice that is not a published name is refused, naming the field."""
    silence = base64.b64encode(np.zeros(2 * FRAME_SIZE, np.uint8).tobytes()).decode()

    async def body():
        async with connected(persona_address, "moshi", "unused") as (connection, events):
            await connection.session.update(
                session={"type": "realtime", "audio": {"output": {"voice": "../secrets"}}}
            )
            await events.wait("session.updated")
            await connection.input_audio_buffer.append(audio=silence)
            error = events.all[await events.wait("error")]["error"]
            assert error["param"] == "session.audio.output.voice", error
            await connection.session.update(
                session={"type": "realtime", "instructions": "You are a calm tutor.",
                         "audio": {"output": {"voice": "NATM1"}}}
            )  # fmt: skip
            updated = await events.wait("session.updated", 2)
            for _ in range(3):
                await connection.input_audio_buffer.append(audio=silence)
            await events.wait("response.output_audio.delta", updated)

    asyncio.run(asyncio.wait_for(body(), 180))
