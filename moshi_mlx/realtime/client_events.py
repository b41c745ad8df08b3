"""What every kind of Realtime session does with a client event before its own handler: pick
the handler by type (`dispatch`: an unknown type or a refused event becomes an `error` event),
read an `input_audio_buffer.append`'s audio (`appended_audio`) and a `response.create`'s
`metadata` (`response_metadata`)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from moshi_mlx.realtime import events
from moshi_mlx.realtime.config import SessionError
from moshi_mlx.realtime.formats import AudioFormat

# Bytes of audio one `input_audio_buffer.append` may carry (base64 decoded).
MAX_APPEND_BYTES = 4 * 1024 * 1024

# A response's metadata, as OpenAI bounds it: pairs, key and value lengths.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

Handler = Callable[[Any, dict], Awaitable[None]]


async def dispatch(
    handlers: Mapping[str, Handler],
    session: Any,
    message: dict[str, Any],
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """Run `message`'s handler on `session`; a SessionError it raises (or an unknown type)
    goes to `emit` as an `error` event carrying the client's `event_id`."""
    kind = message.get("type")
    handler = handlers.get(kind) if isinstance(kind, str) else None
    client_id = message.get("event_id") if isinstance(message.get("event_id"), str) else None
    try:
        if handler is None:
            raise SessionError(f"unknown event type {str(kind)[:60]!r}", "type", "unknown_event")
        await handler(session, message)
    except SessionError as exc:
        emit(events.error(exc.message, exc.param, exc.code, client_event_id=client_id))


def appended_audio(message: dict[str, Any], audio_format: AudioFormat) -> np.ndarray:
    """The samples (float32, 24 kHz) of an append's base64 `audio` in `audio_format`;
    SessionError if it is not a string, too large, not base64 or not whole samples."""
    audio = message.get("audio")
    if not isinstance(audio, str):
        raise SessionError("audio must be a base64 string", "audio")
    if len(audio) > MAX_APPEND_BYTES * 4 // 3 + 4:
        raise SessionError(f"audio is over {MAX_APPEND_BYTES} bytes", "audio", "too_large")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise SessionError("audio is not valid base64", "audio") from None
    if len(data) % audio_format.bytes_per_sample:
        raise SessionError(f"{audio_format.type} audio must hold whole samples", "audio")
    return audio_format.decode(data)


def response_metadata(options: dict[str, Any]) -> dict[str, str] | None:
    """A `response.create`'s `response.metadata` (string pairs the response objects echo, as
    clients such as LiveKit's match their request to `response.created` by it), or None;
    SessionError if it is not an object of string pairs within the bounds above."""
    metadata = options.get("metadata")
    if metadata is None:
        return None
    param = "response.metadata"
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise SessionError(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs", param
        )
    for key, value in metadata.items():
        if (
            not isinstance(value, str)
            or len(key) > MAX_METADATA_KEY
            or len(value) > MAX_METADATA_VALUE
        ):
            raise SessionError(
                f"metadata keys (at most {MAX_METADATA_KEY} characters) must map to strings "
                f"(at most {MAX_METADATA_VALUE})",
                param,
            )
    return dict(metadata)
