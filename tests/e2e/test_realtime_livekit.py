"""LiveKit Agents' OpenAI realtime plugin (`livekit-plugins-openai`), unmodified, against
`python -m moshi_mlx serve` on real tiny models: its `RealtimeModel(base_url=...)` session is
driven without a LiveKit room or server (an asyncio loop; the plugin opens its own aiohttp
session), through the calls an `AgentSession` makes: `generate_reply`, `push_audio`,
`interrupt` and the generations' message streams.

The server is tests/e2e/test_realtime_e2e.py's (`tiny_server`, `speech`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from assistant_cli import WORD
from realtime_helpers import WAIT
from test_realtime_e2e import speech, tiny_server  # noqa: F401 (fixtures)

from moshi_mlx.runtime.codec import FRAME_SIZE

rtc = pytest.importorskip("livekit.rtc")
realtime = pytest.importorskip("livekit.plugins.openai.realtime")


async def _hear_then_interrupt(session, generation) -> tuple[str, int]:
    """(the text, the count of 24 kHz samples) of `generation`'s message: read until 2 s of
    its audio came, then interrupt it (`response.cancel`) and read its streams to their end."""
    text, samples = [], 0
    message = await anext(generation.message_stream)
    audio = aiter(message.audio_stream)
    while samples < 2 * 24000:
        frame = await anext(audio)
        assert frame.sample_rate == 24000
        samples += frame.samples_per_channel
    session.interrupt()
    async for frame in audio:
        samples += frame.samples_per_channel
    async for piece in message.text_stream:
        text.append(piece)
    return "".join(text), samples


def _frames(pcm: np.ndarray) -> list:
    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2")
    return [
        rtc.AudioFrame(
            data=data[i : i + FRAME_SIZE].tobytes(),
            sample_rate=24000,
            num_channels=1,
            samples_per_channel=len(data[i : i + FRAME_SIZE]),
        )
        for i in range(0, len(data), FRAME_SIZE)
    ]


def test_livekit_plugin_answers_a_reply_request_and_a_spoken_turn(tiny_server, speech):  # noqa: F811
    """`generate_reply` resolves to the server's response (matched by the metadata it
    echoes), whose audio and transcript stream in; `interrupt` cancels it; mic frames from
    `push_audio` are heard by the server's turn detection, transcribed and answered."""
    address, llm, log = tiny_server

    async def body():
        # its default voice, OpenAI's "marin", is the TTS's default voice here
        model = realtime.RealtimeModel(base_url=f"http://{address}/v1", api_key="unused", model=llm)
        session = model.session()
        generations: asyncio.Queue = asyncio.Queue()
        errors, heard, done = [], [], []
        both_done = asyncio.Event()
        session.on("generation_created", generations.put_nowait)
        session.on("error", errors.append)
        session.on("input_audio_transcription_completed", heard.append)

        def on_event(event: dict) -> None:
            if event["type"] == "response.done":
                done.append(event["response"]["status"])
                if len(done) == 2:
                    both_done.set()

        session.on("openai_server_event_received", on_event)
        try:
            asked = await asyncio.wait_for(session.generate_reply(instructions="Say hi."), WAIT)
            assert asked.user_initiated and (await generations.get()) is asked
            text, samples = await asyncio.wait_for(_hear_then_interrupt(session, asked), WAIT)
            print(f"generate_reply: {samples} samples, text {text!r}")
            assert samples >= 2 * 24000 and text
            silence = np.zeros(24000 * 3, np.float32)
            for frame in _frames(np.concatenate([silence[:24000], speech, silence])):
                session.push_audio(frame)
                await asyncio.sleep(FRAME_SIZE / 24000)
            spoken = await asyncio.wait_for(generations.get(), 2 * WAIT)
            assert not spoken.user_initiated  # the server's turn detection answered
            text, samples = await asyncio.wait_for(_hear_then_interrupt(session, spoken), WAIT)
            print(f"spoken turn: {samples} samples, text {text!r}")
            assert samples >= 2 * 24000
            assert any(WORD in event.transcript for event in heard), heard
            # the plugin ends a generation's streams when it interrupts, before the server's
            # `response.done` for it arrives
            await asyncio.wait_for(both_done.wait(), WAIT)
            assert done == ["cancelled", "cancelled"] and not errors, (done, errors)
        finally:
            await session.aclose()
            await model.aclose()

    try:
        asyncio.run(asyncio.wait_for(body(), 6 * WAIT))
    except BaseException:
        print(log.read_text()[-3000:])
        raise
