"""OpenAI's `/v1/audio/transcriptions` request and reply: the multipart form read under caps
(`read_transcription_form`), the transcription one model step at a time
(`transcription_steps`), and the reply in each `response_format` (`render_transcript`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from moshi_mlx.errors import one_line
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.serve.bodies import BadBody, text_of
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.stt.events import SttEvent
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.stt.transcript import cues, to_srt, to_text, to_vtt
from moshi_mlx.stt.words import Word

TRANSCRIPT_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
GRANULARITIES = ("word", "segment")
MAX_FIELD_BYTES = 4096  # a form field other than the file
MAX_FIELDS = 32
SEGMENT_CHARS, SEGMENT_SECONDS = 240, 30.0  # a verbose_json segment's longest run of words
_CHUNK = 64 * 1024


@dataclass
class TranscriptionForm:
    """The fields of a transcription request (OpenAI's names); `prompt` and `temperature` are
    read and not used (the model takes no prompt and decodes greedily)."""

    file: bytes
    filename: str = "audio"
    model: str = ""
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    timestamp_granularities: list[str] = field(default_factory=list)
    stream: bool = False


async def read_transcription_form(request: web.Request, max_file_bytes: int) -> TranscriptionForm:
    """The multipart form of `request`: a 413 `ApiError` as soon as the upload passes
    `max_file_bytes`, a 400 for a form OpenAI's API would refuse."""
    if request.content_length is not None and request.content_length > max_file_bytes + _CHUNK:
        raise _too_large(max_file_bytes)
    if request.content_type != "multipart/form-data":
        raise ApiError(400, "send the audio as multipart/form-data with a 'file' field")
    try:
        reader = await request.multipart()
        form, file = TranscriptionForm(b""), None
        fields = 0
        while (part := await reader.next()) is not None:
            fields += 1
            if fields > MAX_FIELDS:
                raise ApiError(400, f"the form has more than {MAX_FIELDS} fields")
            if part.name == "file":
                file = await _read_capped(part, max_file_bytes, _too_large(max_file_bytes))
                form.filename = (part.filename or "audio")[:200]
            else:
                too_long = ApiError(400, f"field {str(part.name)[:40]!r} is too long", part.name)
                value = await _read_capped(part, MAX_FIELD_BYTES, too_long)
                _set_field(form, part.name or "", text_of(value, f"field {str(part.name)[:40]!r}"))
    except BadBody as exc:
        raise ApiError(exc.status, str(exc), part.name) from None
    # A malformed body (aiohttp's multipart reader: bad headers are an HttpProcessingError).
    except (ValueError, AssertionError, UnicodeDecodeError, HttpProcessingError) as exc:
        raise ApiError(400, f"malformed multipart form: {one_line(exc)}") from None
    if not file:
        raise ApiError(400, "no audio: the form needs a non-empty 'file' field", "file")
    form.file = file
    if not form.model:
        raise ApiError(400, "the 'model' field is required", "model")
    if form.response_format not in TRANSCRIPT_FORMATS:
        raise ApiError(
            400,
            f"response_format must be one of {', '.join(TRANSCRIPT_FORMATS)}",
            "response_format",
        )
    return form


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(
        413, f"the audio file is larger than {max_bytes} bytes", "file", "file_too_large"
    )


async def _read_capped(part, max_bytes: int, too_large: ApiError) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(_CHUNK):
        data += chunk
        if len(data) > max_bytes:
            raise too_large
    return bytes(data)


def _set_field(form: TranscriptionForm, name: str, value: str) -> None:
    if name in ("timestamp_granularities[]", "timestamp_granularities"):
        if value not in GRANULARITIES:
            raise ApiError(
                400, "timestamp_granularities takes 'word' and 'segment'", "timestamp_granularities"
            )
        form.timestamp_granularities.append(value)
    elif name == "stream":
        form.stream = value.strip().lower() == "true"
    elif name in ("model", "language", "prompt", "response_format"):
        setattr(form, name, value.strip() if name != "prompt" else value)


def transcription_steps(model: SttModel, pcm: np.ndarray) -> Iterator[tuple[SttEvent, ...]]:
    """The events of one model step per `next()`: the audio (float32 at 24 kHz) frame by frame,
    then the flush's silence, then the last words (as `transcribe` finds them)."""
    stt = model.speech_to_text()
    frames = math.ceil(len(pcm) / FRAME_SIZE)
    padded = np.zeros(frames * FRAME_SIZE, np.float32)
    padded[: len(pcm)] = pcm
    for frame in padded.reshape(frames, FRAME_SIZE):
        yield stt.step(frame).events
    silence = np.zeros(FRAME_SIZE, np.float32)
    for _ in range(stt.flush_steps):
        yield stt.step(silence).events
    yield stt.finish_stream(0)


def render_transcript(
    form: TranscriptionForm, words: list[Word], seconds: float
) -> tuple[str, str]:
    """(body, content type) of the transcript of `seconds` of audio in `form.response_format`."""
    if form.response_format == "text":
        return to_text(words), "text/plain"
    if form.response_format == "srt":
        return to_srt(words), "text/plain"
    if form.response_format == "vtt":
        return to_vtt(words), "text/vtt"
    text = " ".join(word.text for word in words)
    if form.response_format == "json":
        usage = {"type": "duration", "seconds": math.ceil(seconds)}
        return json.dumps({"text": text, "usage": usage}, ensure_ascii=False), "application/json"
    body: dict = {
        "task": "transcribe",
        "language": form.language or "unknown",
        "duration": round(seconds, 3),
        "text": text,
        "segments": _segments(words),
    }
    if "word" in form.timestamp_granularities:
        body["words"] = [
            {"word": w.text, "start": round(w.start, 3), "end": round(w.end, 3)} for w in words
        ]
    return json.dumps(body, ensure_ascii=False), "application/json"


def _segments(words: list[Word]) -> list[dict]:
    """OpenAI's segments: runs of words; the fields our model has no value for (tokens,
    log probabilities, compression) are neutral."""
    return [
        {
            "id": index,
            "seek": 0,
            "start": round(run[0].start, 3),
            "end": round(run[-1].end, 3),
            "text": " ".join(word.text for word in run),
            "tokens": [],
            "temperature": 0.0,
            "avg_logprob": 0.0,
            "compression_ratio": 1.0,
            "no_speech_prob": 0.0,
        }
        for index, run in enumerate(cues(words, SEGMENT_CHARS, SEGMENT_SECONDS))
    ]
