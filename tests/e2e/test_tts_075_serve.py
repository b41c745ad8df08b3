"""kyutai/tts-0.75b-en-public's layout (the tiny random checkpoint of tests/fixtures/tts_075)
through the products: `python -m moshi_mlx tts --hf-repo FOLDER --voice speech.wav` writes
speech in the recording's voice and refuses a run without one in one line, and `serve`'s
`/v1/audio/voices` + `/v1/audio/speech` speak in a voice cloned from an upload (the `openai`
package as the client), its only voices, and so does Kyutai's `/api/tts_streaming` (an aiohttp
msgpack client written like Unmute's), a stream joining another's batch speaking as alone."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import mlx.core as mx
import msgpack
import numpy as np
import pytest
import soundfile as sf
from assistant_cli import link_tts_folder
from cli_checks import ROOT, error_line, offline_env, run_python
from test_openai_audio import Server, _post_bytes
from test_serve_tts import speak_like_unmute
from tiny_moshi import cached_tiny_moshi

from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.serve.cloned_voices import CLONED_VOICES_ONLY
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.tts.server import TTS_PATH
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest

openai = pytest.importorskip("openai")

FIXTURES = ROOT / "tests" / "fixtures" / "tts_075"
FRAME = 1920


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder laid out like the hub repo: config.json naming the files, and a Mimi."""
    root = tmp_path_factory.mktemp("tts_075") / "tts-0.75b-en-public"
    return link_tts_folder(root, FIXTURES, cached_tiny_moshi(tmp_path_factory)["mimi"])


def _recording(path: Path, seconds: float = 1.5) -> Path:
    t = np.arange(int(seconds * 24_000)) / 24_000
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24_000)
    return path


def _tts(folder: Path, tmp_path: Path, *args):
    return run_python(
        offline_env(tmp_path),
        "-m",
        "moshi_mlx",
        "tts",
        "--hf-repo",
        folder,
        *args,
        cwd=tmp_path,
        timeout=180,
    )


def test_the_command_clones_a_recordings_voice(folder, tmp_path):
    speech = _recording(tmp_path / "speech.wav")
    out = tmp_path / "out.wav"
    done = _tts(folder, tmp_path, "--voice", speech, "Hello there.", "-o", out, "--seed", 3)
    assert done.returncode == 0, done.stderr
    pcm, rate = sf.read(str(out), dtype="float32")
    assert rate == 24_000 and len(pcm) >= FRAME and len(pcm) % FRAME == 0


def test_the_command_without_a_recording_says_it_needs_one(folder, tmp_path):
    line = error_line(_tts(folder, tmp_path, "Hello there.", "-o", tmp_path / "x.wav"))
    assert line.startswith("error: this model clones the voice of a recording: give --voice")
    speech = _recording(tmp_path / "speech.wav")
    args = ("--voice", speech, "--voice", "expresso/x.wav", "Hi.", "-o", tmp_path / "y.wav")
    line = error_line(_tts(folder, tmp_path, *args))
    assert line == "error: this model takes one recording as its voice and no named voices"


@pytest.fixture(scope="module")
def server(folder):
    thread = ModelThread()
    thread.start()
    context = ServeContext(thread, EventTally(logging.getLogger("test")))
    context.tts = thread.call_soon(lambda: TtsModel.load(folder, dtype=mx.float32)).result(300)
    context.add_model("tts", "kyutai/tts-0.75b-en-public")
    server = Server(context)
    yield server
    server.close()
    thread.stop()


def test_speech_is_in_a_voice_cloned_from_an_upload_and_in_no_other(server, tmp_path):
    listed = server.client.get("/audio/voices", cast_to=object)
    assert listed["data"] == [] and listed["aliases"] == {}
    with pytest.raises(openai.BadRequestError, match="this model speaks in cloned voices only"):
        server.client.audio.speech.create(model="tts", voice="alloy", input="Hi there.")
    url = f"{server.url}/v1/audio/voices"
    status, voice = _post_bytes(url, _recording(tmp_path / "me.wav").read_bytes())
    assert status == 200 and voice["id"].startswith("clone-"), voice
    options = {"model": "tts", "voice": voice["id"], "input": "Hi there.", "response_format": "pcm"}
    with server.client.audio.speech.with_streaming_response.create(**options) as response:
        assert response.status_code == 200
        pcm = response.read()
    assert len(pcm) >= 2 * FRAME and len(pcm) % (2 * FRAME) == 0


def test_kyutais_streaming_route_speaks_a_cloned_voice_joining_a_stream_in_progress(
    server, tmp_path, monkeypatch
):
    """`/api/tts_streaming?voice=<clone id>` (msgpack, words sent as Unmute sends them): a
    stream that joins while another speaks (a row of the same `TtsBatch`, each with its null
    row, prefix and masks) gets the words and audio of the API's greedy run alone with that
    prefix; any other voice, and a `Voice` embedding, get the protocol's Error naming the
    upload route (a POST: a 400), no Ready; the server serves on."""
    url = f"{server.url}/v1/audio/voices"
    recording = _recording(tmp_path / "me.wav")
    status, voice = _post_bytes(url, recording.read_bytes())
    assert status == 200, voice
    address, context = server.address, server.context
    busy_at_add = []  # the rows busy when each stream joined
    add = TtsBatch.add
    monkeypatch.setattr(
        TtsBatch, "add", lambda batch, r: busy_at_add.append(len(batch.busy_rows)) or add(batch, r)
    )
    query = f"?format=PcmMessagePack&voice={voice['id']}&temperature=0&cfg_alpha=2"
    first, second = ["Hello", "there,", "my", "good", "friend."], ["Hi", "there."]

    async def both():
        async def later():
            await asyncio.sleep(0.3)
            return await speak_like_unmute(address, second, query=query)

        return await asyncio.gather(speak_like_unmute(address, first, query=query), later())

    (messages_first, _), (messages_second, _) = asyncio.run(both())
    assert busy_at_add == [0, 1]  # the second joined the first's batch in progress
    prefix = context.thread.call_soon(lambda: context.tts.voice_prefix(recording)).result(60)
    for words, messages in ((first, messages_first), (second, messages_second)):
        assert not [m for m in messages if m["type"] == "Error"], messages
        assert [m["text"] for m in messages if m["type"] == "Text"] == words
        request = TtsRequest(" ".join(words), (), 2.0, prefix)
        (alone,) = context.thread.call_soon(
            lambda request=request: context.tts.synthesize([request], GREEDY, GREEDY)
        ).result(120)
        pcm = [np.array(m["pcm"], np.float32) for m in messages if m["type"] == "Audio"]
        assert pcm and all(len(frame) == FRAME for frame in pcm)
        np.testing.assert_allclose(np.concatenate(pcm), alone.pcm, rtol=0, atol=1e-4)

    async def refused(query: str, embedding: bool = False):
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"ws://{address}{TTS_PATH}{query}") as ws:
                if embedding:
                    assert msgpack.unpackb((await ws.receive(timeout=10)).data)["type"] == "Ready"
                    shape = [1, 4, 2]
                    await ws.send_bytes(
                        msgpack.packb({"type": "Voice", "embeddings": [0.0] * 8, "shape": shape})
                    )
                    await ws.send_bytes(msgpack.packb({"type": "Text", "text": "Hi."}))
                reply = msgpack.unpackb((await ws.receive(timeout=10)).data)
                closing = await ws.receive(timeout=10)
            post = await session.post(f"http://{address}{TTS_PATH}", json={"text": "Hi."})
            return reply, closing.type, post.status, await post.text()

    for refused_query, embedding in (("?voice=alloy", False), ("", False), (query, True)):
        reply, closing, status, text = asyncio.run(refused(refused_query, embedding))
        assert reply["type"] == "Error" and "cloned voices only" in reply["message"], reply
        assert closing in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert status == 400 and text == CLONED_VOICES_ONLY
    messages, _ = asyncio.run(speak_like_unmute(address, second, query=query))
    assert [m["text"] for m in messages if m["type"] == "Text"] == second
