"""`python -m moshi_mlx serve --stt --tts --llm` with real tiny models, `/v1/realtime` through
the `openai` package's realtime client and through Pipecat's OpenAI Realtime service.

The STT is `moshi_mlx.testing.turn_stt`'s, whose pause head fires (random STT weights never
end a turn) and which hears the one word "weather" in any speech; the TTS is the random tiny
checkpoint of tests/fixtures/tts; the LLM `moshi_mlx.testing.llm`'s, which rambles. The user
speaks espeak-ng speech, paced as a microphone would send it, then silence.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from assistant_cli import WORD, write_model_flags
from realtime_helpers import WAIT, connected
from tiny_moshi import espeak_speech
from unmute_backend import free_port, get_json, wait_until

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.serve.cloned_voices import CLONED_VOICES_ONLY
from moshi_mlx.tts.voices import DEFAULT_VOICE

ROOT = Path(__file__).resolve().parents[2]
TTS_FIXTURES = ROOT / "tests" / "fixtures" / "tts"
TTS_075_FIXTURES = ROOT / "tests" / "fixtures" / "tts_075"
FIXTURE_VOICE_ID = "0badf00d@7"  # the tiny TTS's model id, as voice files name it


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> np.ndarray:
    made = espeak_speech(tmp_path_factory.mktemp("speech") / "user.wav", "What is the weather?")
    if made is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    return read_audio(made)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The server on a loopback port: (host:port, the LLM's model id, its log)."""
    root = tmp_path_factory.mktemp("realtime_server")
    flags = write_model_flags(root)
    flags = flags[: flags.index("--voice")]  # serve takes voices from a voice repo
    voices = root / "voices"
    voice = voices / f"{DEFAULT_VOICE}.{FIXTURE_VOICE_ID}.safetensors"  # may hold folders
    voice.parent.mkdir(parents=True)
    shutil.copyfile(TTS_FIXTURES / "voices" / "alice.safetensors", voice)  # no link out
    yield from _serve(root, [*flags, "--voice-repo", str(voices)])


@pytest.fixture(scope="module")
def cloning_server(tmp_path_factory):
    """`tiny_server` with the TTS of tests/fixtures/tts_075 (kyutai/tts-0.75b-en-public's
    layout: it speaks in voices cloned from uploads only) instead."""
    root = tmp_path_factory.mktemp("realtime_cloning_server")
    flags = write_model_flags(root, tts_fixtures=TTS_075_FIXTURES)
    yield from _serve(root, flags[: flags.index("--voice")])


def _serve(root: Path, flags: list[str]):
    """`python -m moshi_mlx serve FLAGS` on a loopback port, offline, until the end of the
    module: yields (host:port, the LLM's model id, its log)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf"))
    env["MOSHI_MLX_WEIGHTS"] = str(root / "no_weights")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "moshi_mlx", "serve", *flags, "--llm-max-tokens", "16"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    address = f"127.0.0.1:{port}"
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            wait_until(lambda: get_json(f"http://{address}/v1/models") is not None, 300, server)
            models = get_json(f"http://{address}/v1/models")["data"]
            yield address, models[0]["id"], root / "server.log"
        finally:
            server.terminate()
            server.wait(timeout=30)


async def _send_paced(connection, pcm: np.ndarray) -> None:
    """`pcm` (24 kHz) in 80 ms appends at real time, as a microphone sends it."""
    for start in range(0, len(pcm), FRAME_SIZE):
        chunk = pcm[start : start + FRAME_SIZE]
        data = (np.clip(chunk, -1, 1) * 32767).astype("<i2").tobytes()
        await connection.input_audio_buffer.append(audio=base64.b64encode(data).decode())
        await asyncio.sleep(FRAME_SIZE / 24000)


def test_a_spoken_turn_on_real_tiny_models(tiny_server, speech):
    address, llm, log = tiny_server
    silence = np.zeros(24000 * 3, np.float32)

    async def body():
        async with connected(address, model=llm) as (connection, events):
            await _send_paced(connection, np.concatenate([silence[:24000], speech, silence]))
            started = await events.wait("input_audio_buffer.speech_started")
            stopped = await events.wait("input_audio_buffer.speech_stopped", started)
            completed = events.all[
                await events.wait("conversation.item.input_audio_transcription.completed")
            ]
            assert WORD in completed["transcript"]
            first_audio = await events.wait("response.output_audio.delta", stopped)
            done = events.all[await events.wait("response.done", first_audio)]["response"]
            assert done["status"] == "completed", done
            deltas = [e for e in events.all if e["type"] == "response.output_audio.delta"]
            pcm = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in deltas), "<i2")
            assert len(pcm) == len(deltas) * FRAME_SIZE and np.abs(pcm).max() > 0

    try:
        asyncio.run(asyncio.wait_for(body(), 4 * WAIT))
    except BaseException:
        print(log.read_text()[-3000:])
        raise


def test_a_session_speaks_in_a_voice_cloned_by_upload(tiny_server, tmp_path):
    """The id `POST /v1/audio/voices` gives is a session's voice (`session.update`): the
    answer to a text turn is spoken in it; an id the server does not keep is an `error`
    event on the voice, and the session goes on."""
    address, llm, log = tiny_server
    voice_id = _cloned_voice(address, tmp_path)

    async def body():
        async with connected(address, model=llm) as (connection, events):
            unknown = "clone-" + "0" * 24
            await connection.session.update(
                session={"type": "realtime", "audio": {"output": {"voice": unknown}}}
            )
            error = (await events.event("error"))["error"]
            assert error["code"] == "voice_not_found" and "unknown cloned voice" in error["message"]
            await _speak_in(connection, events, voice_id)
            await _ask(connection)
            await connection.response.create()
            done = events.all[await events.wait("response.done")]["response"]
            assert done["status"] == "completed", done
            assert events.of("response.output_audio.delta")

    try:
        asyncio.run(asyncio.wait_for(body(), 4 * WAIT))
    except BaseException:
        print(log.read_text()[-3000:])
        raise


async def _ask(connection) -> None:
    """A user's text turn in the conversation (no response asked yet)."""
    await connection.conversation.item.create(
        item={
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "What is the weather?"}],
        }
    )


async def _speak_in(connection, events, voice_id: str) -> None:
    """The session's voice set to `voice_id`, with answers of two tokens (a second of speech,
    not twenty or thirty), and the update confirmed."""
    await connection.session.update(
        session={
            "type": "realtime",
            "audio": {"output": {"voice": voice_id}},
            "max_output_tokens": 2,
        }
    )
    updated = (await events.event("session.updated"))["session"]
    assert updated["audio"]["output"]["voice"] == voice_id


def _cloned_voice(address: str, tmp_path: Path) -> str:
    """The id of a voice cloned by `POST /v1/audio/voices` from a second of a tone."""
    recording = tmp_path / "me.wav"
    t = np.arange(24_000) / 24_000
    sf.write(str(recording), (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24_000)
    upload = urllib.request.Request(
        f"http://{address}/v1/audio/voices", recording.read_bytes(), method="POST"
    )
    with urllib.request.urlopen(upload, timeout=120) as answer:
        return json.loads(answer.read())["id"]


def test_a_tts_of_cloned_voices_only_speaks_an_uploaded_voice_and_refuses_others(
    cloning_server, tmp_path
):
    """A server whose TTS speaks in cloned voices only (kyutai/tts-0.75b-en-public's layout):
    a session starts with no voice (`null`, not a name it would refuse); an answer to be
    spoken before one is set, and an OpenAI voice name, are `error` events naming the upload
    route, and the session goes on; in the id `POST /v1/audio/voices` gives, a text turn is
    answered in speech."""
    address, llm, log = cloning_server

    def refused(event: dict) -> None:
        error = event["error"]
        assert error["code"] == "voice_not_found", error
        assert error["param"] == "session.audio.output.voice"
        assert error["message"] == CLONED_VOICES_ONLY

    async def body():
        async with connected(address, model=llm) as (connection, events):
            assert events.all[0]["session"]["audio"]["output"]["voice"] is None
            await _ask(connection)
            await connection.response.create()
            refused(await events.event("error"))
            for voice in ("marin", {"id": "alloy"}):
                after = len(events.all)
                await connection.session.update(
                    session={"type": "realtime", "audio": {"output": {"voice": voice}}}
                )
                refused(await events.event("error", after))
            assert not events.of("response.created") and not events.of("session.updated")
            voice_id = _cloned_voice(address, tmp_path)
            await _speak_in(connection, events, voice_id)
            await connection.response.create()
            done = (await events.event("response.done"))["response"]
            assert done["status"] == "completed", done
            assert done["audio"]["output"]["voice"] == voice_id
            deltas = events.of("response.output_audio.delta")
            pcm = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in deltas), "<i2")
            assert deltas and len(pcm) == len(deltas) * FRAME_SIZE and np.abs(pcm).max() > 0
        said = log.read_text()  # at start-up: why, and where the assistant's page takes an id
        assert f"TTS: {CLONED_VOICES_ONLY}" in said and "assistant at /assistant/?voice=ID" in said

    try:
        asyncio.run(asyncio.wait_for(body(), 4 * WAIT))
    except BaseException:
        print(log.read_text()[-3000:])
        raise


def test_pipecat_runs_a_pipeline_over_the_server(tiny_server, speech):
    """Pipecat's `OpenAIRealtimeLLMService`, unmodified, pointed at our `base_url` in a
    pipeline: the context's user message is answered in speech (TTS audio frames come down
    the pipeline), then the user's spoken turn (audio frames in) is transcribed."""
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import (
        InputAudioRawFrame,
        LLMContextFrame,
        TTSAudioRawFrame,
        TTSStartedFrame,
    )
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.tests.utils import SleepFrame, run_test

    address, llm, log = tiny_server
    service = OpenAIRealtimeLLMService(
        api_key="unused",
        base_url=f"ws://{address}/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model=llm),
    )
    context = LLMContext([{"role": "user", "content": "What is the weather?"}])
    pcm = np.concatenate([speech, np.zeros(24000 * 2, np.float32)])
    audio = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    frames = [LLMContextFrame(context), SleepFrame(sleep=8.0)]
    chunk = 2 * FRAME_SIZE
    frames += [
        InputAudioRawFrame(audio=audio[i : i + chunk], sample_rate=24000, num_channels=1)
        for i in range(0, len(audio), chunk)
    ]
    frames.append(SleepFrame(sleep=6.0))
    try:
        down, _ = asyncio.run(run_test(service, frames_to_send=frames, start_timeout=10.0))
    except BaseException:
        print(log.read_text()[-3000:])
        raise
    kinds = [type(frame).__name__ for frame in down]
    assert TTSStartedFrame.__name__ in kinds, kinds
    spoken = [frame for frame in down if isinstance(frame, TTSAudioRawFrame)]
    assert spoken and all(frame.sample_rate == 24000 for frame in spoken)
    # the server's turn detection heard the user (speech_started / speech_stopped)
    assert (
        "ProposedUserStartedSpeakingFrame" in kinds and "ProposedUserStoppedSpeakingFrame" in kinds
    )
    print(f"{len(spoken)} audio frames; frames down: {sorted(set(kinds))}")
