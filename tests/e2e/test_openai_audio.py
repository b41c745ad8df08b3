"""OpenAI's audio API (`/v1/audio/transcriptions`, `/v1/audio/speech`, `/v1/audio/voices`)
through `python -m moshi_mlx serve`'s app, on tiny random STT and TTS checkpoints, driven by
the `openai` package; hostile requests get OpenAI's 4xx errors and the server goes on."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from served_app import LoopbackServer
from tiny_moshi import cached_tiny_stt, espeak_speech, load_tiny_stt, load_tiny_tts

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.openai.audio import AudioLimits
from moshi_mlx.serve.openai.voices import OPENAI_VOICES
from moshi_mlx.stt.transcriber import transcribe
from moshi_mlx.stt.words import finished_words
from moshi_mlx.tts.voices import DEFAULT_VOICE, voice_file_name

openai = pytest.importorskip("openai")

TTS_FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
SENTENCE = "hello there how are you today"
LIMITS = AudioLimits()


class Server(LoopbackServer):
    """The serve app over `context` on a free loopback port, and the `openai` client of it."""

    def __init__(self, context: ServeContext):
        super().__init__(context, lambda guard: create_app(context, guard))
        self.context = context
        self.url = f"http://{self.address}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


def _voice_folder(root: Path, config) -> Path:
    """A folder laid out like kyutai/tts-voices for the tiny TTS: the default voice and one
    more; and a link out of it to a voice file beside it (`out.wav`), which it does not offer."""
    folder = root / "voices"
    for name, source in ((DEFAULT_VOICE, "alice"), ("vctk/bob.wav", "bob")):
        path = folder / voice_file_name(name, config)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TTS_FIXTURES / "voices" / f"{source}.safetensors", path)
    shutil.copy(TTS_FIXTURES / "voices" / "bob.safetensors", root / "secret.safetensors")
    (folder / voice_file_name("out.wav", config)).symlink_to(root / "secret.safetensors")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = cached_tiny_stt(tmp_path_factory)
    thread = ModelThread()
    thread.start()
    context = ServeContext(thread, EventTally(__import__("logging").getLogger("test")))

    context.stt = thread.call_soon(lambda: load_tiny_stt(files)).result(300)
    context.tts = thread.call_soon(lambda: load_tiny_tts(files["mimi"])).result(300)
    context.voice_repo = str(_voice_folder(tmp_path_factory.mktemp("voices"), context.tts.config))
    context.add_model("stt", str(files["moshi"].parent))
    context.add_model("tts", "kyutai/tts-tiny")
    server = Server(context)
    yield server
    server.close()
    thread.stop()


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory) -> Path:
    path = espeak_speech(tmp_path_factory.mktemp("speech") / "hello.wav", SENTENCE, rate=16_000)
    if path is None:
        pytest.skip("needs espeak-ng and sox")
    return path


def _transcribe(server: Server, path: Path, **options):
    with open(path, "rb") as file:
        return server.client.audio.transcriptions.create(model="stt", file=file, **options)


def _idle(thread: ModelThread, timeout: float = 30.0) -> bool:
    """Whether the model thread runs no background job (within `timeout`)."""
    deadline = time.monotonic() + timeout
    while thread._jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    return not thread._jobs


def test_models_lists_every_served_model_and_each_is_found(server):
    """`/v1/models` lists the STT and the TTS under the ids the routes answer to (a folder's
    base name, no path); `models.retrieve` finds each."""
    ids = [model.id for model in server.client.models.list().data]
    assert ids == [server.context.model_names["stt"], "kyutai/tts-tiny"]
    assert "/" not in ids[0]
    for model_id in ids:
        assert server.client.models.retrieve(model_id).id == model_id


# --- transcriptions --------------------------------------------------------------------------


def test_transcriptions_in_every_format_agree_with_the_transcriber(server, speech_wav):
    expected = finished_words(
        server.context.thread.call_soon(
            lambda: transcribe(server.context.stt, [read_audio(speech_wav)])[0]
        ).result(120)
    )
    assert expected, "the tiny model says no word: nothing to compare"
    text = " ".join(word.text for word in expected)

    assert _transcribe(server, speech_wav).text == text  # json
    assert _transcribe(server, speech_wav, response_format="text") == text + "\n"

    verbose = _transcribe(
        server,
        speech_wav,
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        language="en",
        prompt="ignored",
    )
    assert verbose.text == text and verbose.language == "en"
    assert verbose.duration == pytest.approx(len(sf.read(speech_wav)[0]) / 16_000, abs=1e-3)
    assert [(w.word, w.start, w.end) for w in verbose.words] == [
        (w.text, round(w.start, 3), round(w.end, 3)) for w in expected
    ]
    assert " ".join(segment.text for segment in verbose.segments) == text
    assert verbose.segments[0].start == verbose.words[0].start
    assert verbose.segments[-1].end == verbose.words[-1].end
    without_words = _transcribe(server, speech_wav, response_format="verbose_json")
    assert without_words.words is None and without_words.segments

    srt = _transcribe(server, speech_wav, response_format="srt")
    assert srt.startswith("1\n00:00:") and " --> " in srt
    assert " ".join(block.split("\n", 2)[2].strip() for block in srt.split("\n\n")) == text
    vtt = _transcribe(server, speech_wav, response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:") and "." in vtt.split(" --> ")[0]


def test_a_streamed_transcription_sends_each_word_as_it_is_found(server, speech_wav):
    text = _transcribe(server, speech_wav).text
    events = list(_transcribe(server, speech_wav, stream=True))
    assert [event.type for event in events] == ["transcript.text.delta"] * (len(events) - 1) + [
        "transcript.text.done"
    ]
    assert "".join(event.delta for event in events[:-1]) == events[-1].text == text
    assert len(events) == len(text.split()) + 1
    _error(
        lambda: _transcribe(server, speech_wav, stream=True, response_format="srt"), 400, "stream"
    )


@pytest.mark.parametrize(
    ("suffix", "subtype", "rate", "channels"),
    [
        ("flac", "PCM_16", 44_100, 2),
        ("ogg", "VORBIS", 48_000, 1),
        ("ogg", "OPUS", 48_000, 1),
        ("mp3", "MPEG_LAYER_III", 22_050, 1),
    ],
)
def test_transcriptions_read_any_format_libsndfile_reads(
    server, speech_wav, tmp_path, suffix, subtype, rate, channels
):
    from moshi_mlx.audio.resample import resample

    pcm, source_rate = sf.read(speech_wav, dtype="float32")
    pcm = np.repeat(resample(pcm, source_rate, rate)[:, None], channels, axis=1)
    path = tmp_path / f"speech.{suffix}"
    sf.write(path, pcm, rate, subtype=subtype)
    verbose = _transcribe(server, path, response_format="verbose_json")
    assert verbose.duration == pytest.approx(len(pcm) / rate, abs=0.1)


# --- speech ----------------------------------------------------------------------------------


def _speech(server: Server, path: Path, **options) -> bytes:
    options = {"model": "tts", "voice": "alloy", "input": "Hi there.", **options}
    with server.client.audio.speech.with_streaming_response.create(**options) as response:
        assert response.status_code == 200
        response.stream_to_file(path)
    return path.read_bytes()


@pytest.mark.parametrize("stream", [False, True])
def test_speech_as_wav_reads_back_at_24_khz(server, tmp_path, stream):
    path = tmp_path / "speech.wav"
    data = _speech(server, path, response_format="wav", extra_body={"stream": stream})
    pcm, rate = sf.read(path, dtype="float32")
    assert rate == 24_000 and pcm.ndim == 1 and len(pcm) >= 1920
    assert len(pcm) % 1920 == 0 and np.abs(pcm).max() > 0
    declared = int.from_bytes(data[40:44], "little")
    assert declared == (0xFFFFFFFF if stream else len(data) - 44)


@pytest.mark.parametrize(
    ("response_format", "stream"),
    [
        ("pcm", False),
        ("pcm", True),
        ("opus", False),
        ("opus", True),
        ("flac", False),
        ("mp3", True),
    ],
)
def test_speech_in_pcm_opus_flac_and_mp3(server, tmp_path, response_format, stream):
    """pcm: 16-bit samples, whole frames; the others read back by libsndfile (Opus decodes at
    48 kHz; FLAC and MP3 asked to stream come whole at the end)."""
    path = tmp_path / f"speech.{response_format}"
    data = _speech(server, path, response_format=response_format, extra_body={"stream": stream})
    if response_format == "pcm":
        assert len(data) >= 2 * 1920 and len(data) % (2 * 1920) == 0
        return
    audio, rate = sf.read(path, dtype="float32")
    assert rate == (48_000 if response_format == "opus" else 24_000)
    assert len(audio) >= 1920 * rate // 24_000


def test_speech_in_each_listed_voice(server, tmp_path):
    listed = server.client.get("/audio/voices", cast_to=object)
    names = [voice["id"] for voice in listed["data"]]
    assert names == sorted([DEFAULT_VOICE, "vctk/bob.wav"])
    assert listed["default"] == DEFAULT_VOICE
    assert set(listed["aliases"]) == set(OPENAI_VOICES)
    for name in names:
        pcm = _speech(server, tmp_path / "v.pcm", voice=name, response_format="pcm")
        assert len(pcm) >= 2 * 1920
    custom = {"id": "vctk/bob.wav"}  # OpenAI's custom voice object
    assert _speech(server, tmp_path / "c.pcm", voice=custom, response_format="pcm")
    as_unmute = voice_file_name("vctk/bob.wav", server.context.tts.config)  # its file's name
    assert _speech(server, tmp_path / "u.pcm", voice=as_unmute, response_format="pcm")


def _post_bytes(url: str, data: bytes) -> tuple[int, dict]:
    """POST `data` as the body: the status and the JSON answer."""
    request = urllib.request.Request(url, data, {"Content-Type": "audio/wav"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_voice_cloned_from_an_upload_is_kept_by_content_and_named(server, tmp_path):
    """POST /v1/audio/voices with a recording: its id (the same for the same recording),
    then speech in that voice by id (or OpenAI's {"id": ...}); no audio: a 400 on 'file'."""
    t = np.arange(int(1.5 * 24_000)) / 24_000
    path = tmp_path / "me.wav"
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24_000)
    url = f"{server.url}/v1/audio/voices"
    status, voice = _post_bytes(url, path.read_bytes())
    assert status == 200, voice
    assert voice["object"] == "audio.voice" and voice["id"].startswith("clone-")
    assert voice["seconds"] == pytest.approx(17 * 0.08)  # 19 frames less the 2 dropped
    assert _post_bytes(url, path.read_bytes())[1]["id"] == voice["id"]
    cloned = _speech(server, tmp_path / "clone.pcm", voice=voice["id"], response_format="pcm")
    assert len(cloned) >= 2 * 1920
    assert _speech(server, tmp_path / "c2.pcm", voice={"id": voice["id"]}, response_format="pcm")
    status, bad = _post_bytes(url, b"not audio at all" * 10)
    assert status == 400 and bad["error"]["param"] == "file"
    unknown = "clone-" + "0" * 24  # never made here (or forgotten): a 400 on 'voice'
    speak = server.client.audio.speech.create
    assert "unknown cloned voice" in _error(
        lambda: speak(model="tts", voice=unknown, input="Hi."), 400, "voice"
    )


# --- hostile requests ------------------------------------------------------------------------


def _error(call, status: int, param: str | None = None) -> str:
    """The message of the OpenAI error `call` raises, checking its status and shape."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    error = caught.value
    assert error.status_code == status, error
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param
    return body["message"]


def test_uploads_that_are_no_audio_or_too_big_or_too_long_are_refused(server, tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("these are not the samples you are looking for\n" * 100)
    assert "cannot read the file as audio" in _error(lambda: _transcribe(server, text), 400, "file")

    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    _error(lambda: _transcribe(server, empty), 400, "file")

    huge = tmp_path / "huge.wav"
    with open(huge, "wb") as file:
        file.truncate(LIMITS.max_upload_bytes + 1)
    assert "larger than" in _error(lambda: _transcribe(server, huge), 413, "file")

    long = tmp_path / "long.wav"
    seconds = LIMITS.max_audio_seconds + 1
    sf.write(long, np.zeros(int(seconds * 8000), np.int16), 8000, subtype="PCM_16")
    assert "more than the" in _error(lambda: _transcribe(server, long), 400, "file")

    assert "BytesIO" not in _error(lambda: _transcribe(server, text), 400, "file")

    _error(lambda: _transcribe(server, text, response_format="tsv"), 400, "response_format")
    part = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    for content_type, body in (
        ("multipart/form-data; boundary=xyz", b"garbage"),
        ("multipart/form-data", part),
        ("multipart/form-data; boundary=xyz", part + b"\xff" * 1000),  # never closed
        ("application/json", b"{}"),
    ):
        request = urllib.request.Request(
            f"{server.url}/v1/audio/transcriptions", body, {"Content-Type": content_type}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 400, (content_type, body[:20])
        assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}
    assert _transcribe(server, _tone(tmp_path), response_format="text") is not None  # serving


def _tone(tmp_path: Path) -> Path:
    path = tmp_path / "tone.wav"
    t = np.arange(24_000) / 24_000
    sf.write(path, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 24_000)
    return path


def test_bad_speech_requests_are_refused(server, tmp_path):
    speech = server.client.audio.speech.create
    long = "a " * (LIMITS.max_input_chars // 2 + 1)
    assert "longer than" in _error(
        lambda: speech(model="tts", voice="alloy", input=long), 400, "input"
    )
    _error(lambda: speech(model="tts", voice="alloy", input="  "), 400, "input")
    _error(lambda: speech(model="tts", voice="../../etc/passwd", input="hi"), 400, "voice")
    _error(lambda: speech(model="tts", voice="/tmp/x.safetensors", input="hi"), 400, "voice")
    for voice in ("out.wav", "vctk/../out.wav", "vctk/nobody.wav", "a" * 5000):  # a link out
        assert "unknown voice" in _error(
            lambda voice=voice: speech(model="tts", voice=voice, input="hi"), 400, "voice"
        )
    _error(lambda: speech(model="tts", voice="alloy", input="hi", speed=2.0), 400, "speed")
    _error(
        lambda: speech(model="tts", voice="alloy", input="hi", response_format="aac"),
        400,
        "response_format",
    )

    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b'{"input": "' + b"a" * 70_000 + b'"}'):
        request = urllib.request.Request(f"{server.url}/v1/audio/speech", data=body)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code in (400, 413)
        assert set(json.loads(caught.value.read())["error"]) == {"message", "type", "param", "code"}
    assert _speech(server, tmp_path / "ok.pcm", response_format="pcm")  # still serving


def test_a_client_that_leaves_mid_stream_stops_its_speech(server, tmp_path):
    """Read the headers and the first bytes of a streamed speech, hang up: the server stops
    that speech's steps and serves the next request."""
    body = json.dumps(
        {
            "model": "tts",
            "voice": "alloy",
            "input": "This is a long text, so that the speech goes on. " * 80,
            "response_format": "pcm",
            "stream": True,
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while b"\r\n\r\n" not in received or len(received.split(b"\r\n\r\n", 1)[1]) < 100:
            chunk = sock.recv(65536)
            assert chunk, received[:200]
            received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    assert _idle(server.context.thread, timeout=20)
    assert _speech(server, tmp_path / "next.pcm", response_format="pcm")


def test_a_server_with_keys_wants_one(server, tmp_path):
    server.context.api_keys = frozenset({"secret"})
    try:
        _error(lambda: server.client.get("/audio/voices", cast_to=object), 401)
        _error(lambda: _transcribe(server, _tone(tmp_path)), 401)
        keyed = server.client.with_options(api_key="secret")
        assert keyed.get("/audio/voices", cast_to=object)["data"]
    finally:
        server.context.api_keys = frozenset()


def test_a_failing_model_is_a_500_and_the_server_goes_on(server, tmp_path, monkeypatch):
    from moshi_mlx.serve.openai import audio

    def failing_steps(*args):
        yield ()
        raise RuntimeError("the model\nbroke")

    def failing_frames(frames, max_frames):
        yield np.zeros(1920, np.float32)
        raise RuntimeError("the codec broke")

    monkeypatch.setattr(audio, "transcription_steps", failing_steps)
    monkeypatch.setattr(audio, "_spoken_frames", failing_frames)
    tone = _tone(tmp_path)
    assert "the model broke" in _error(lambda: _transcribe(server, tone), 500)
    _error(lambda: _speech(server, tmp_path / "x.wav", response_format="wav"), 500)
    with pytest.raises(Exception, match="incomplete chunked read"):  # headers sent: cut short
        _speech(server, tmp_path / "x.pcm", response_format="pcm", extra_body={"stream": True})
    monkeypatch.undo()
    assert _transcribe(server, tone, response_format="text") is not None
    assert _idle(server.context.thread)


def test_a_hostile_session_keeps_the_log_short_and_free_of_tracebacks(server, tmp_path, caplog):
    """Junk on every route of a server with STT and TTS (deep JSON, bad UTF-8, wrong types,
    broken forms, text uploaded as audio, msgpack bombs, unknown routes): every answer is a
    4xx or a protocol Error, the log holds no traceback nor error, and stays short."""
    deep = b"[" * 100_000 + b"]" * 100_000
    junk_bodies = [deep, b"\xff\xfe", b"[1]", b'{"input": 5, "model": "tts", "voice": []}']
    form = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    forms = [form + b"not audio\r\n--b--\r\n", form + b"\r\n--b--\r\n", b"--b\r\n\xff" * 999]
    bomb = b"\xdd" + (3_800_000).to_bytes(4, "big") + b"\x90" * 3_800_000

    def status(path: str, body: bytes | None = None, content_type: str = "") -> int:
        headers = {"Content-Type": content_type} if content_type else {}
        request = urllib.request.Request(f"{server.url}{path}", body, headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    async def websocket_junk() -> list[str]:
        import aiohttp

        errors = []
        async with aiohttp.ClientSession() as session:
            for path, frames in (
                ("/api/asr-streaming", [deep, bomb, "text"]),
                ("/api/tts_streaming", [deep, bomb, b"\xc1"]),
            ):
                for frame in frames:
                    async with session.ws_connect(f"ws://127.0.0.1:{server.port}{path}") as ws:
                        await ws.receive(timeout=10)  # Ready
                        await (ws.send_str if isinstance(frame, str) else ws.send_bytes)(frame)
                        reply = await ws.receive(timeout=10)
                        if reply.type == aiohttp.WSMsgType.BINARY:
                            errors.append(__import__("msgpack").unpackb(reply.data)["type"])
        return errors

    with caplog.at_level(logging.DEBUG):
        statuses = [status("/v1/audio/speech", body) for body in junk_bodies]
        statuses += [status("/api/tts_streaming", body) for body in junk_bodies]
        multipart = "multipart/form-data; boundary=b"
        statuses += [status("/v1/audio/transcriptions", body, multipart) for body in forms]
        statuses += [status(path) for path in ("/v1/embeddings", "/v1/responses", "/v1/x/../y")]
        statuses.append(status("/api/tts_streaming?format=wav&seed=-1"))
        replies = asyncio.run(websocket_junk())
    assert all(400 <= code < 500 for code in statuses), str(list(enumerate(statuses)))
    assert replies == ["Error"] * 6
    records = caplog.records
    assert not [r for r in records if r.exc_info or r.levelno >= logging.ERROR]
    assert sum(len(r.getMessage()) for r in records) < 4000, [r.getMessage() for r in records]
    assert _transcribe(server, _tone(tmp_path), response_format="text") is not None  # serving
