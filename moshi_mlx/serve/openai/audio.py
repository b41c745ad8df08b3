"""OpenAI's audio API on our speech-to-text and text-to-speech models:

- `POST /v1/audio/transcriptions` (multipart: `file` in any format libsndfile reads, `model`,
  `language` echoed in verbose_json, `prompt` read and ignored: the model takes none;
  `response_format` json | text | verbose_json | srt | vtt; `timestamp_granularities[]`
  word adds verbose_json's `words`; `stream=true`: server-sent `transcript.text.delta` per
  word as the model finds it, then `transcript.text.done`);
- `POST /v1/audio/speech` (JSON: `model`, `input`, `voice` a name of `/v1/audio/voices` or one
  of OpenAI's, which all stand for the default voice; `response_format` mp3 (OpenAI's default)
  | opus | flac | wav | pcm at 24 kHz; `speed` 1.0 only; `stream: true` or
  `stream_format: "audio"` sends wav, pcm and Opus as the model speaks);
- `GET /v1/audio/voices`; `POST /v1/audio/voices` (a recording as the body, at most 30 s:
  a voice cloned from it, kept by content, `{"id": "clone-..."}` to name as a speech
  request's `voice`; `serve/cloned_voices.py`).

Model work runs on the server's model thread one step per `next()` (`ModelThread.background`),
so long files and long speech never hold up the real-time streams beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aiohttp import web

from moshi_mlx.audio.wav import decode_audio
from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
from moshi_mlx.errors import AudioError, MoshiError, TtsError, one_line
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.serve.bodies import BadBody, read_bytes
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.openai.errors import (
    ApiError,
    answers_api_errors,
    check_bearer_key,
    optional_bool,
    optional_number,
    optional_str,
    read_json_object,
)
from moshi_mlx.serve.openai.speech_formats import (
    CONTENT_TYPES,
    SPEECH_FORMATS,
    STREAMED_FORMATS,
    SpeechStreamEncoder,
    encode_speech,
)
from moshi_mlx.serve.openai.transcriptions import (
    read_transcription_form,
    render_transcript,
    transcription_steps,
)
from moshi_mlx.serve.openai.voices import OPENAI_VOICES, VoiceCatalog
from moshi_mlx.stt.events import SttEvent, WordStarted
from moshi_mlx.stt.words import finished_words
from moshi_mlx.tts.prefix import MAX_PREFIX_SECONDS
from moshi_mlx.tts.synthesizer import TtsModel
from moshi_mlx.tts.voices import DEFAULT_VOICE

log = logging.getLogger("moshi_mlx.serve")

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
SPEECH_PATH = "/v1/audio/speech"
VOICES_PATH = "/v1/audio/voices"


@dataclass(frozen=True)
class AudioLimits:
    """Caps of the audio routes (OpenAI's where it has one)."""

    max_upload_bytes: int = 25 * 1024 * 1024  # OpenAI's 25 MB
    upload_seconds: float = 120.0  # to send the whole form (a slow upload holds a slot)
    max_audio_seconds: float = 600.0  # a transcribed file's length
    max_input_chars: int = 4096  # OpenAI's cap on speech input
    max_speech_seconds: float = 600.0  # speech made for one request
    max_json_bytes: int = 64 * 1024  # a speech request's body
    max_transcriptions: int = 4  # at once; more: 429
    max_speeches: int = 4  # at once; more: 429


class _Slots:
    """At most `size` requests at once; the next gets a 429."""

    def __init__(self, size: int, what: str):
        self.size = size
        self.what = what
        self.used = 0

    @contextlib.contextmanager
    def taken(self) -> Iterator[None]:
        if self.used >= self.size:
            raise ApiError(
                429, f"{self.size} {self.what} are running: try again later", None, "busy"
            )
        self.used += 1
        try:
            yield
        finally:
            self.used -= 1


def add_routes(
    app: web.Application, context: ServeContext, limits: AudioLimits | None = None
) -> None:
    """Mount the audio routes of the models `context` holds (transcriptions with an STT
    model, speech and voices with a TTS model)."""
    limits = limits or AudioLimits()
    if context.stt is not None:
        transcriptions = _Transcriptions(context, limits)
        app.router.add_post(TRANSCRIPTIONS_PATH, answers_api_errors(transcriptions.handle))
    if context.tts is not None:
        voice_repo = context.voice_repo or context.tts.voice_repo or DEFAULT_VOICE_REPO
        catalog = VoiceCatalog(context.tts.config, voice_repo)
        speech = _Speech(context, limits, catalog)
        app.router.add_post(SPEECH_PATH, answers_api_errors(speech.handle))
        app.router.add_get(VOICES_PATH, answers_api_errors(speech.voices))
        app.router.add_post(VOICES_PATH, answers_api_errors(speech.clone))


def _model_failed(what: str, exc: Exception) -> ApiError:
    log.error("a %s failed: %s", what, one_line(exc))
    return ApiError(500, f"the {what} failed: {one_line(exc)}")


def _cut(request: web.Request, what: str, exc: Exception) -> None:
    """End a response whose headers are sent (the client sees the body cut short)."""
    log.error("a %s failed mid-stream: %s", what, one_line(exc))
    if request.transport is not None:
        request.transport.close()


def _gone(request: web.Request) -> bool:
    """Whether the client has closed its connection."""
    return request.transport is None or request.transport.is_closing()


class _Transcriptions:
    def __init__(self, context: ServeContext, limits: AudioLimits):
        self.context = context
        self.limits = limits
        self.slots = _Slots(limits.max_transcriptions, "transcriptions")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        check_bearer_key(request, self.context.key_allowed)
        with self.slots.taken():
            try:
                form = await asyncio.wait_for(
                    read_transcription_form(request, self.limits.max_upload_bytes),
                    self.limits.upload_seconds,
                )
            except asyncio.TimeoutError:
                raise ApiError(
                    408, f"the upload took more than {self.limits.upload_seconds:g} s"
                ) from None
            if form.stream and form.response_format not in ("json", "text"):
                raise ApiError(400, "a streamed transcription is json or text", "stream")
            try:
                pcm = await asyncio.to_thread(
                    decode_audio, form.file, SAMPLE_RATE, self.limits.max_audio_seconds, "the file"
                )
            except AudioError as exc:
                raise ApiError(400, one_line(exc), "file", "invalid_audio") from None
            form.file = b""
            steps = self.context.thread.background(transcription_steps(self.context.stt, pcm))
            try:
                if form.stream:
                    return await _stream_transcript(request, steps)
                events = []
                async for step_events in steps:
                    events.extend(step_events)
                    if _gone(request):
                        return web.Response(status=499)
            except ConnectionError:  # the client has gone
                raise
            except Exception as exc:  # noqa: BLE001 - the model failed, or its thread stopped
                raise _model_failed("transcription", exc) from None
            finally:
                await steps.aclose()
        words = finished_words(events)
        body, content_type = render_transcript(form, words, len(pcm) / SAMPLE_RATE)
        return web.Response(text=body, content_type=content_type)


async def _stream_transcript(
    request: web.Request, steps: AsyncIterator[tuple[SttEvent, ...]]
) -> web.StreamResponse:
    """OpenAI's transcription events (server-sent): a `transcript.text.delta` per word as the
    model finds it, then `transcript.text.done` with the whole text."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    words: list[str] = []
    try:
        async for events in steps:
            for event in events:
                if isinstance(event, WordStarted):
                    delta = event.text if not words else " " + event.text
                    words.append(event.text)
                    await response.write(_sse({"type": "transcript.text.delta", "delta": delta}))
    except ConnectionError:  # the client has gone
        raise
    except Exception as exc:  # noqa: BLE001 - the model failed, or its thread stopped
        _cut(request, "transcription", exc)
        return response
    await response.write(_sse({"type": "transcript.text.done", "text": " ".join(words)}))
    await response.write_eof()
    return response


def _sse(event: dict) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


@dataclass(frozen=True)
class _SpeechRequest:
    text: str
    voice: str
    response_format: str
    stream: bool


class _Speech:
    def __init__(self, context: ServeContext, limits: AudioLimits, catalog: VoiceCatalog):
        self.context = context
        self.limits = limits
        self.catalog = catalog
        self.tts: TtsModel = context.tts
        self.slots = _Slots(limits.max_speeches, "speech requests")
        self.cloned = context.cloned_voices
        self.clones_only = self.tts.clones_only

    async def clone(self, request: web.Request) -> web.StreamResponse:
        """A voice cloned from the recording in the body: its id (the same for the same
        recording)."""
        check_bearer_key(request, self.context.key_allowed)
        with self.slots.taken():
            try:
                data = await read_bytes(request, self.limits.max_upload_bytes)
                pcm = decode_audio(data, SAMPLE_RATE, MAX_PREFIX_SECONDS, "the recording")
                prefix = await self.context.thread.call(lambda: self.tts.voice_prefix(pcm))
            except BadBody as exc:
                raise ApiError(exc.status, str(exc), "file") from None
            except AudioError as exc:
                raise ApiError(400, one_line(exc), "file") from None
            except MoshiError as exc:  # the model thread has stopped
                raise ApiError(503, one_line(exc)) from None
        voice_id = self.cloned.add(prefix)
        seconds = prefix.shape[1] * FRAME_SIZE / SAMPLE_RATE
        return web.json_response(
            {"id": voice_id, "object": "audio.voice", "name": voice_id, "seconds": seconds}
        )

    async def voices(self, request: web.Request) -> web.StreamResponse:
        check_bearer_key(request, self.context.key_allowed)
        names = [] if self.clones_only else await asyncio.to_thread(self.catalog.names)
        data = [{"id": name, "object": "voice", "name": name} for name in names]
        aliases = {} if self.clones_only else dict.fromkeys(OPENAI_VOICES, DEFAULT_VOICE)
        return web.json_response(
            {"object": "list", "data": data, "default": DEFAULT_VOICE, "aliases": aliases}
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        check_bearer_key(request, self.context.key_allowed)
        with self.slots.taken():
            speech = _speech_request(
                await read_json_object(request, self.limits.max_json_bytes), self.limits
            )
            try:
                if self.clones_only:
                    voice, prefix = None, self.cloned.clone_prefix(speech.voice)
                else:
                    voice, prefix = self.cloned.resolve(speech.voice)
            except TtsError as exc:
                raise ApiError(400, one_line(exc), "voice", "voice_not_found") from None
            try:
                voice_file = None
                if not self.clones_only:
                    voice_file = await asyncio.to_thread(self.catalog.resolve, voice)
                stream = await self.context.thread.call(
                    lambda: _open_stream(self.tts, voice_file, speech.text, prefix)
                )
            except TtsError as exc:  # the voice's file is missing or unreadable
                raise ApiError(400, one_line(exc), "voice") from None
            except MoshiError as exc:  # the model thread has stopped
                raise ApiError(503, one_line(exc)) from None
            max_frames = math.ceil(self.limits.max_speech_seconds * SAMPLE_RATE / FRAME_SIZE)
            frames = self.context.thread.background(_spoken_frames(stream.frames(), max_frames))
            try:
                if speech.stream and speech.response_format in STREAMED_FORMATS:
                    return await _stream_speech(request, speech.response_format, frames)
                return await _whole_speech(request, speech, frames)
            except ConnectionError:  # the client has gone
                raise
            except Exception as exc:  # noqa: BLE001 - the model failed, or its thread stopped
                raise _model_failed("speech", exc) from None
            finally:
                await frames.aclose()


def _speech_request(body: dict, limits: AudioLimits) -> _SpeechRequest:
    """The speech request of OpenAI's JSON `body`; a 400 `ApiError` naming a bad field."""
    model, text, voice = body.get("model"), body.get("input"), body.get("voice")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", "model")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "'input' must be a non-empty string", "input")
    if len(text) > limits.max_input_chars:
        raise ApiError(
            400,
            f"'input' is longer than {limits.max_input_chars} characters",
            "input",
            "input_too_long",
        )
    if isinstance(voice, dict):  # OpenAI's custom voice object {"id": ...}
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise ApiError(400, "'voice' must be a voice name (GET /v1/audio/voices)", "voice")
    response_format = body.get("response_format", "mp3")
    if response_format not in SPEECH_FORMATS:
        raise ApiError(
            400, f"response_format must be one of {', '.join(SPEECH_FORMATS)}", "response_format"
        )
    if optional_number(body, "speed", 0.25, 4.0, 1.0) != 1.0:
        raise ApiError(400, "only speed 1.0 is supported", "speed")
    stream_format = optional_str(body, "stream_format")
    if stream_format not in (None, "audio"):
        raise ApiError(400, "only stream_format 'audio' is supported", "stream_format")
    stream = optional_bool(body, "stream") or stream_format == "audio"
    return _SpeechRequest(text, voice, response_format, stream)


def _open_stream(
    tts: TtsModel, voice_file: Path | None, text: str, prefix: np.ndarray | None = None
):
    """A `TtsStream` in `voice_file`'s voice (None: a model without voice embeddings)
    continuing a cloned voice's `prefix` (if given), `text` pushed and closed (on the model
    thread)."""
    stream = tts.stream(voice=() if voice_file is None else voice_file, prefix=prefix)
    stream.push(text)
    stream.close()
    return stream


def _spoken_frames(frames: Iterator[np.ndarray | None], max_frames: int) -> Iterator[np.ndarray]:
    """The frames of speech (the model steps that play none yield nothing), at most
    `max_frames` of them."""
    spoken = 0
    for frame in frames:
        if frame is not None:
            yield frame
            spoken += 1
            if spoken >= max_frames:
                return


async def _whole_speech(
    request: web.Request, speech: _SpeechRequest, frames: AsyncIterator[np.ndarray]
) -> web.StreamResponse:
    pcm = []
    async for frame in frames:
        pcm.append(frame)
        if _gone(request):
            return web.Response(status=499)
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    body = await asyncio.to_thread(encode_speech, speech.response_format, audio)
    return web.Response(body=body, content_type=CONTENT_TYPES[speech.response_format])


async def _stream_speech(
    request: web.Request, response_format: str, frames: AsyncIterator[np.ndarray]
) -> web.StreamResponse:
    """Send each frame as it is made (chunked); a model failure after the headers ends the
    connection without the last chunk, which tells the client the audio is cut."""
    encoder = SpeechStreamEncoder(response_format)
    response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPES[response_format]})
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        await response.write(encoder.start())
        async for frame in frames:
            await response.write(encoder.encode(frame))
        await response.write(encoder.finish())
    except ConnectionError:  # the client has gone
        raise
    except Exception as exc:  # noqa: BLE001 - the model failed, or its thread stopped
        _cut(request, "speech", exc)
        return response
    await response.write_eof()
    return response
