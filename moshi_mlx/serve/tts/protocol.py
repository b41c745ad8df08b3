"""moshi-server's text-to-speech messages (`/api/tts_streaming`), as msgpack maps with "type".

Client to server: `Text{text}` (words; Unmute sends one word per message), `Voice{embeddings,
shape}` (a voice embedding, float32 (1, dim, frames) flattened), `Eos` (the text is complete);
a websocket text frame is text too, and a binary frame holding one zero byte is the end.
Server to client (`PcmMessagePack`): `Ready` at once, `Audio{pcm}` (1920 float32 samples, 80
ms at 24 kHz) per frame, `Text{text, start_s, stop_s}` per spoken word, `Error{message}`;
the server closes the websocket once the audio is done. `Pcm` sends raw little-endian
float32 frames only; `OggOpus` an Ogg Opus stream; `OggOpusMessagePack` its pages as
`OggOpus{data}` messages beside `Ready`, `Text` and `Error`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from moshi_mlx.serve.bodies import BadBody, ProtocolError, unpack_msgpack

FORMATS = ("PcmMessagePack", "Pcm", "OggOpus", "OggOpusMessagePack")
END_OF_TEXT = b"\0"
MAX_TEXT_CHARS = 4096  # per message
MAX_VOICE_FLOATS = 512 * 1024  # (1, 512, 1000): 80 s of a 512-wide voice embedding
# The largest valid message: a voice of float64 numbers, a little framing.
MAX_MESSAGE_BYTES = 9 * MAX_VOICE_FLOATS + 1024
_MAX_CONTAINERS = 4  # one map, the embedding and its shape
_MAX_KEYS = 8


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Voice:
    """A voice embedding sent by the client: (1, dim, frames) float32."""

    embedding: np.ndarray


@dataclass(frozen=True)
class Eos:
    """The text is complete."""


ClientMessage = Text | Voice | Eos


def parse(data: bytes) -> ClientMessage:
    """The client message in a binary frame; `ProtocolError` naming what is wrong."""
    if data == END_OF_TEXT:
        return Eos()
    try:
        message = unpack_msgpack(
            data,
            _MAX_CONTAINERS,
            max_array_len=MAX_VOICE_FLOATS,
            max_map_len=_MAX_KEYS,
            max_str_len=4 * MAX_TEXT_CHARS,
            max_bin_len=0,
            max_ext_len=0,
        )
    except BadBody:
        raise ProtocolError("not a msgpack message of this protocol (Text, Voice or Eos)") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError('a message must be a msgpack map with a string "type"')
    kind = message["type"]
    if kind == "Text":
        return text_message(message.get("text"))
    if kind == "Eos":
        return Eos()
    if kind == "Voice":
        return Voice(_embedding(message.get("embeddings"), message.get("shape")))
    raise ProtocolError(f"unknown message type {kind[:40]!r}; expected Text, Voice or Eos")


def text_message(text: object) -> Text:
    if not isinstance(text, str):
        raise ProtocolError('Text needs "text", a string')
    if len(text) > MAX_TEXT_CHARS:
        raise ProtocolError(f"a Text message may hold at most {MAX_TEXT_CHARS} characters")
    return Text(text)


def _embedding(values: object, shape: object) -> np.ndarray:
    if not isinstance(values, list) or not all(type(x) in (float, int) for x in values):
        raise ProtocolError('Voice needs "embeddings", a list of numbers')
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(type(n) is int and n > 0 for n in shape)
        or shape[0] != 1
        or shape[1] * shape[2] != len(values)
    ):
        raise ProtocolError('Voice needs "shape" [1, dim, frames] matching its embeddings')
    embedding = np.array(values, np.float32).reshape(shape)
    if not np.isfinite(embedding).all():
        raise ProtocolError("Voice embeddings hold NaN or infinity")
    return embedding


def _pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True, use_single_float=False)


def ready() -> bytes:
    return _pack({"type": "Ready"})


def error(message: str) -> bytes:
    return _pack({"type": "Error", "message": message})


def audio(pcm: np.ndarray) -> bytes:
    """An Audio message: float32 samples (msgpack float32, as Kyutai's Rust server packs)."""
    return msgpack.packb(
        {"type": "Audio", "pcm": np.asarray(pcm, np.float32).tolist()}, use_single_float=True
    )


def word(text: str, start_s: float, stop_s: float) -> bytes:
    return _pack({"type": "Text", "text": text, "start_s": start_s, "stop_s": stop_s})


def ogg_opus(data: bytes) -> bytes:
    return _pack({"type": "OggOpus", "data": data})
