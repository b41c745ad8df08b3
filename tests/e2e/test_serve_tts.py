"""`/api/tts_streaming` of `python -m moshi_mlx serve` on the tiny TTS fixture, with a client
written like Unmute's (`unmute/tts/text_to_speech.py`: msgpack Text per word, then Eos), and
the server's hardening (keys that are not UTF-8, msgpack bombs, capped log values)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import tracemalloc
from pathlib import Path
from urllib.parse import quote

import aiohttp
import mlx.core as mx
import msgpack
import numpy as np
import pytest
import soundfile as sf
from served_app import served
from tiny_moshi import load_tiny_tts

from moshi_mlx.errors import MoshiError
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.logtext import capped
from moshi_mlx.serve.stt import protocol as stt_protocol
from moshi_mlx.serve.tts import protocol
from moshi_mlx.serve.tts.server import MAX_POST_BYTES, TTS_PATH, log
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import TtsRequest
from moshi_mlx.tts.voices import DEFAULT_VOICE, VOICE_TENSOR, voice_file_name

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
ALICE = FIXTURES / "voices" / "alice.safetensors"


VOICE = "vctk/alice.wav"  # ALICE's name in the server's voice folder


def _voice_folder(root: Path, config) -> Path:
    """A folder laid out like kyutai/tts-voices holding ALICE as `VOICE`, and two links out of
    it (a file, a folder) to a voice file beside it."""
    folder, outside = root / "voices", root / "outside"
    (folder / "vctk").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(ALICE, folder / voice_file_name(VOICE, config))
    shutil.copy(ALICE, outside / voice_file_name("secret.wav", config))
    (folder / voice_file_name("out.wav", config)).symlink_to(
        outside / voice_file_name("secret.wav", config)
    )
    (folder / "linked").symlink_to(outside, target_is_directory=True)
    return folder


@pytest.fixture(scope="module")
def server(full_mimi_checkpoint, tmp_path_factory):
    thread = ModelThread("test-model")
    thread.start()
    model = thread.call_soon(lambda: load_tiny_tts(full_mimi_checkpoint)).result(120)
    context = ServeContext(thread, EventTally(log), tts=model, api_keys=frozenset({"secret"}))
    context.voice_repo = str(_voice_folder(tmp_path_factory.mktemp("tts_voices"), model.config))
    with served(context, lambda guard: create_app(context, guard)) as address:
        yield address, context
    thread.stop()


API_KEY = "kyutai-api-key"
HEADERS = {API_KEY: "secret"}
QUERY = f"?format=PcmMessagePack&voice={VOICE}&cfg_alpha=1.5&seed=1"


async def speak_like_unmute(
    address: str, words: list[str], voice: np.ndarray | None = None, query: str = QUERY
) -> tuple[list[dict], float]:
    """Connect, wait for Ready, send the `voice` embedding (if any: a Voice message), one Text
    per word and Eos; (messages, time to first audio after the first word)."""
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"ws://{address}{TTS_PATH}{query}", headers=HEADERS) as ws,
    ):
        first = msgpack.unpackb((await ws.receive(timeout=5)).data)
        assert first == {"type": "Ready"}
        if voice is not None:
            embeddings = voice.ravel().tolist()
            await ws.send_bytes(
                msgpack.packb({"type": "Voice", "embeddings": embeddings, "shape": voice.shape})
            )
        sent = time.monotonic()
        for word in words:
            await ws.send_bytes(msgpack.packb({"type": "Text", "text": word}))
        await ws.send_bytes(msgpack.packb({"type": "Eos"}))
        messages, first_audio = [], None
        while True:
            message = await ws.receive(timeout=60)
            if message.type != aiohttp.WSMsgType.BINARY:
                return messages, first_audio
            messages.append(msgpack.unpackb(message.data))
            if first_audio is None and messages[-1]["type"] == "Audio":
                first_audio = time.monotonic() - sent


def test_audio_frames_and_word_timings_then_close(server):
    address, _ = server
    messages, first_audio = asyncio.run(speak_like_unmute(address, ["Hello", "there", "friend."]))
    audio = [m for m in messages if m["type"] == "Audio"]
    words = [m for m in messages if m["type"] == "Text"]
    assert audio and all(len(m["pcm"]) == 1920 for m in audio)
    assert not [m for m in messages if m["type"] == "Error"]
    for word in words:
        assert 0 <= word["start_s"] <= word["stop_s"] and word["text"]
    print(f"time to first audio: {first_audio * 1e3:.0f} ms, {len(audio)} frames")


def _pcm(messages: list[dict]) -> list[bytes]:
    return [m["pcm"] for m in messages if m["type"] == "Audio"]


def test_a_voice_the_client_sends_speaks_as_its_file_is_written_nowhere_and_kept(
    server, monkeypatch
):
    """Its embedding is used as sent (no file): the audio of ALICE's file, sample for sample;
    sent again, it is the same voice of the model's cache (projected once)."""
    address, context = server

    def no_file(*args, **kwargs):
        raise AssertionError("a voice was written to a file")

    monkeypatch.setattr(mx, "save_safetensors", no_file)
    embedding = np.array(mx.load(str(ALICE))[VOICE_TENSOR])
    words = ["Hello", "there."]
    by_file, _ = asyncio.run(speak_like_unmute(address, words))
    sent, _ = asyncio.run(speak_like_unmute(address, words, voice=embedding))
    assert _pcm(sent) and _pcm(sent) == _pcm(by_file)
    again, _ = asyncio.run(speak_like_unmute(address, words, voice=embedding))
    assert _pcm(again) == _pcm(sent)
    kept = [voices for voices, _ in context.tts.voice_cache.keys_values.choices()]
    assert sum(voices[0][0] == "embedding" for voices in kept) == 1


def test_a_voice_of_the_wrong_width_is_refused_in_one_line(server):
    address, _ = server
    messages, _ = asyncio.run(
        speak_like_unmute(address, ["Hello."], voice=np.zeros((1, 3, 4), np.float32))
    )
    errors = [m["message"] for m in messages if m["type"] == "Error"]
    needs = "this model needs [1, 16, frames] with at least one frame"
    assert errors == [f"the voice embedding has shape [1, 3, 4], {needs}"]
    assert not _pcm(messages)


def test_two_streams_at_once_both_finish(server):
    address, _ = server

    async def both():
        return await asyncio.gather(
            speak_like_unmute(address, ["One", "two."]),
            speak_like_unmute(address, ["Three", "four."]),
        )

    for messages, _ in asyncio.run(both()):
        assert any(m["type"] == "Audio" for m in messages)


def test_post_answers_a_streamed_wav(server):
    address, _ = server

    async def post():
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                f"http://{address}{TTS_PATH}",
                json={"text": "Hi there.", "voice": VOICE},
                headers=HEADERS,
            )
            return response.status, await response.read()

    status, body = asyncio.run(post())
    assert status == 200 and body[:4] == b"RIFF" and body[8:12] == b"WAVE"
    assert len(body) > 44 and (len(body) - 44) % 2 == 0


def test_a_voice_cloned_by_upload_is_named_in_the_query_and_continues_its_recording(
    server, tmp_path, monkeypatch
):
    """POST /v1/audio/voices gives an id; `?voice=<id>` streams with that recording as the
    audio prefix (in the default voice's embedding): its batch row takes the recording's
    codes, and its words and audio are those of the API's greedy run with that prefix. An id the server does not keep gets the protocol's
    Error and a close (a POST: a 400), no traceback."""
    address, context = server
    default = tmp_path / voice_file_name(DEFAULT_VOICE, context.tts.config)
    default.parent.mkdir(parents=True)
    default.write_bytes(ALICE.read_bytes())
    monkeypatch.setattr(context, "voice_repo", str(tmp_path))
    recording = tmp_path / "me.wav"
    t = np.arange(24_000) / 24_000
    sf.write(str(recording), (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24_000)
    words = ["Hello", "there."]
    added = []  # the requests the server's batches took
    add = TtsBatch.add
    monkeypatch.setattr(TtsBatch, "add", lambda batch, r: added.append(r) or add(batch, r))

    async def clone_and_speak(voice_id: str | None = None):
        async with aiohttp.ClientSession() as session:
            if voice_id is None:
                response = await session.post(
                    f"http://{address}/v1/audio/voices",
                    data=recording.read_bytes(),
                    headers={"Authorization": "Bearer secret"},
                )
                assert response.status == 200, await response.text()
                voice_id = (await response.json())["id"]
            query = f"?format=PcmMessagePack&voice={voice_id}&temperature=0&cfg_alpha=2"
            messages, _ = await speak_like_unmute(address, words, query=query)
            return voice_id, messages

    _, messages = asyncio.run(clone_and_speak())
    prefix = context.thread.call_soon(lambda: context.tts.voice_prefix(recording)).result(60)
    assert len(added) == 1 and np.array_equal(added[0].prefix, prefix)
    assert added[0].voices == (default,)
    request = TtsRequest(" ".join(words), (default,), 2.0, prefix)
    (alone,) = context.thread.call_soon(
        lambda: context.tts.synthesize([request], GREEDY, GREEDY)
    ).result(120)
    assert not [m for m in messages if m["type"] == "Error"], messages
    assert [m["text"] for m in messages if m["type"] == "Text"] == words
    pcm = np.concatenate([np.array(m["pcm"], np.float32) for m in messages if m["type"] == "Audio"])
    # The start is the API's; later steps of this random model have near-ties that a batch of
    # another size may break either way (where the speech ends moves).
    start = 8 * 1920
    np.testing.assert_allclose(pcm[:start], alone.pcm[:start], rtol=0, atol=2e-3)

    async def unknown():
        async with aiohttp.ClientSession() as session:
            query = "?format=PcmMessagePack&voice=clone-000000000000000000000000"
            async with session.ws_connect(
                f"ws://{address}{TTS_PATH}{query}", headers=HEADERS
            ) as ws:
                replies = [msgpack.unpackb((await ws.receive(timeout=10)).data)]
                closing = await ws.receive(timeout=10)
            body = {"text": "Hi.", "voice": "clone-000000000000000000000000"}
            post = await session.post(f"http://{address}{TTS_PATH}", json=body, headers=HEADERS)
            return replies, closing.type, post.status, await post.text()

    replies, closing, status, text = asyncio.run(unknown())
    assert replies == [{"type": "Error", "message": replies[0]["message"]}]
    assert replies[0]["message"].startswith("unknown cloned voice 'clone-0000")
    assert closing in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert status == 400 and text.startswith("unknown cloned voice")


def test_a_voice_outside_the_voice_folder_is_refused_and_the_server_serves_on(server, caplog):
    """A client's voice names a voice of the server's voice folder, never a file of its disk:
    an absolute path, a `..` path, a link out of the folder (a file, a folder) and a name it
    does not hold each get the protocol's one-line Error and a close (POST: a 400), the value
    cut short in the log, no traceback; the next client speaks, in a voice named as Unmute
    names it (with its embedding suffix)."""
    address, context = server
    suffix = voice_file_name("", context.tts.config)
    refused = [
        str(ALICE),
        f"vctk/../../outside/secret.wav{suffix}",
        "../outside/secret.wav",
        "out.wav",
        f"linked/secret.wav{suffix}",
        "vctk/nobody.wav",
        "/" + "x" * 5000 + ".safetensors",
    ]

    async def ask(voice: str):
        async with aiohttp.ClientSession() as session:
            query = f"?format=PcmMessagePack&voice={quote(voice)}"
            async with session.ws_connect(
                f"ws://{address}{TTS_PATH}{query}", headers=HEADERS
            ) as ws:
                reply = msgpack.unpackb((await ws.receive(timeout=10)).data)
                closing = await ws.receive(timeout=10)
            body = {"text": "Hi.", "voice": voice}
            post = await session.post(f"http://{address}{TTS_PATH}", json=body, headers=HEADERS)
            return reply, closing.type, post.status, await post.text()

    with caplog.at_level(logging.DEBUG):
        answers = [asyncio.run(ask(voice)) for voice in refused]
    for voice, (reply, closing, status, text) in zip(refused, answers):
        assert reply["type"] == "Error" and reply["message"].startswith("unknown voice"), voice
        assert "\n" not in reply["message"] and "/tmp" not in reply["message"]
        assert closing in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert status == 400 and text.startswith("unknown voice"), (voice, text)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert max(len(r.getMessage()) for r in caplog.records) < 400
    as_unmute = f"?format=PcmMessagePack&voice={VOICE}{suffix}&seed=1"
    messages, _ = asyncio.run(speak_like_unmute(address, ["Hello."], query=as_unmute))
    assert _pcm(messages) and not [m for m in messages if m["type"] == "Error"]


def test_a_key_whose_bytes_are_not_utf8_is_refused_with_401(server):
    address, _ = server
    host, port = address.split(":")

    async def raw_request() -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"GET " + TTS_PATH.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"kyutai-api-key: \xff\xfe\xc3\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        status = await reader.readline()
        writer.close()
        return status

    assert b" 401 " in asyncio.run(raw_request())


def test_unknown_message_gets_an_error_and_a_bomb_is_refused_cheaply(server):
    address, _ = server
    bomb = b"\xdd" + (3_800_000).to_bytes(4, "big") + b"\x90" * 3_800_000  # nested empty arrays

    async def send(payload: bytes):
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://{address}{TTS_PATH}{QUERY}", headers=HEADERS) as ws,
        ):
            await ws.receive(timeout=5)  # Ready
            started = time.monotonic()
            await ws.send_bytes(payload)
            reply = await ws.receive(timeout=10)
            return msgpack.unpackb(reply.data), time.monotonic() - started

    reply, elapsed = asyncio.run(send(bomb))
    assert reply["type"] == "Error" and "msgpack" in reply["message"]
    assert elapsed < 2.0


@pytest.mark.parametrize("parse", [protocol.parse, stt_protocol.parse], ids=["tts", "stt"])
def test_a_msgpack_bomb_decodes_into_little_memory(parse):
    """3.8 MB of nested empty arrays: refused before it decodes into millions of lists."""
    bomb = b"\xdd" + (3_800_000).to_bytes(4, "big") + b"\x90" * 3_800_000
    deep = b"\x91" * 3_800_000 + b"\x90"
    for payload in (bomb, deep):
        tracemalloc.start()
        with pytest.raises(MoshiError):
            parse(payload)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 20e6, peak


def test_client_values_in_log_lines_are_capped():
    line = capped("9" * 4000)
    assert len(line) < 120 and line.endswith("(4000 chars)")
    assert capped("a\nb\x1b[31m") == "a?b?[31m"
    assert capped("\udcff") == "\\udcff"


def test_modules_and_build_info(server):
    """`/api/build_info` is open (Unmute's health check); `/api/modules_info` wants the key."""
    address, _ = server

    async def get():
        async with aiohttp.ClientSession() as session:
            url = f"http://{address}/api/modules_info"
            refused = [(await session.get(url, headers=h)).status for h in ({}, {API_KEY: "no"})]
            modules = await (await session.get(url, headers=HEADERS)).json()
            by_query = (await session.get(f"{url}?auth_id=secret")).status
            build = await (await session.get(f"http://{address}/api/build_info")).json()
            return refused, modules, by_query, build

    refused, modules, by_query, build = asyncio.run(get())
    assert refused == [401, 401] and by_query == 200
    assert modules == [
        {
            "type": "py",
            "path": TTS_PATH,
            "script": "tts.py",
            "used_slots": "0",
            "total_slots": "2",  # the TTS batch's rows: `max_tts_streams`, 2 by default
        }
    ]
    assert "git_describe" in build and "moshi_mlx" in build["git_describe"]
    assert np.isfinite(len(modules))


def test_post_bodies_that_are_no_request_get_a_4xx_and_log_no_traceback(server, caplog):
    """JSON nested 100,000 deep (a RecursionError in `json.loads`), bytes that are not UTF-8,
    a body past the cap, JSON of the wrong type: each a 4xx, none a traceback in the log."""
    address, _ = server
    bodies = [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"\xff\xfe{}",
        b"[1, 2]",
        b'{"text": 5}',
        b"null",
        b'{"text": "' + b"a" * (MAX_POST_BYTES + 10) + b'"}',
    ]

    async def post(body: bytes) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            url = f"http://{address}{TTS_PATH}"
            async with session.post(url, data=body, headers=HEADERS) as response:
                return response.status, await response.text()

    with caplog.at_level(logging.DEBUG):
        answers = [asyncio.run(post(body)) for body in bodies]
    statuses = [status for status, _ in answers]
    assert statuses == [400, 400, 400, 400, 400, 400, 413], answers
    assert "nests too deep" in answers[0][1] and "not UTF-8" in answers[2][1]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
