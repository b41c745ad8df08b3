"""Kyutai's streaming speech-to-text protocol (the Rust `moshi-server`'s `/api/asr-streaming`).

Every websocket message is one binary msgpack map whose `"type"` names it.

Client to server:

| type | fields | meaning |
| --- | --- | --- |
| Audio | pcm: [float] | 24 kHz mono samples, any number per message |
| Marker | id: int | echo `id` back once the audio sent before it is transcribed |
| Init | | accepted and ignored (Kyutai's batched server uses it internally) |

Server to client:

| type | fields | meaning |
| --- | --- | --- |
| Ready | | the stream exists; sent first |
| Word | text, start_time | a word, and when it began (seconds of the client's audio) |
| EndWord | stop_time | the last word ended then |
| Step | step_idx, prs, buffered_pcm | one 80 ms step: steps so far, each pause head's probability, samples still waiting |
| Marker | id | the client's marker, after every word of the audio sent before it |
| Error | message | why the server closes the connection |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from moshi_mlx.audio import SAMPLE_RATE
from moshi_mlx.serve.bodies import BadBody, ProtocolError, unpack_msgpack

MAX_AUDIO_SECONDS = 10
MAX_AUDIO_SAMPLES = MAX_AUDIO_SECONDS * SAMPLE_RATE  # per Audio message
# The largest valid message: every sample a msgpack float64 (9 bytes), a little framing.
MAX_MESSAGE_BYTES = 9 * MAX_AUDIO_SAMPLES + 1024
_MAX_KEYS = 16
_MAX_CONTAINERS = 4  # a message is one map holding at most one array
_MAX_STRING = 1024
_I64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Audio:
    """Client audio: (n,) float32 samples, 24 kHz mono."""

    pcm: np.ndarray


@dataclass(frozen=True)
class Marker:
    """A client marker, echoed back once the audio before it is transcribed."""

    id: int


@dataclass(frozen=True)
class Init:
    """Kyutai's internal stream (re)start; clients have no reason to send it."""


ClientMessage = Audio | Marker | Init


def parse(data: bytes) -> ClientMessage:
    """The client message in `data`; `ProtocolError` naming what is wrong with it."""
    try:
        message = unpack_msgpack(
            data,
            _MAX_CONTAINERS,
            max_array_len=MAX_AUDIO_SAMPLES,
            max_map_len=_MAX_KEYS,
            max_str_len=_MAX_STRING,
            max_bin_len=MAX_MESSAGE_BYTES,
        )
    except BadBody as exc:
        if "max_array_len" in str(exc):
            raise ProtocolError(
                f"an Audio message may carry at most {MAX_AUDIO_SAMPLES} samples "
                f"({MAX_AUDIO_SECONDS} s); send smaller chunks"
            ) from None
        raise ProtocolError("not a msgpack message with string keys") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError('a message must be a msgpack map with a string "type"')
    kind = message["type"]
    if kind == "Audio":
        return Audio(_pcm(message.get("pcm")))
    if kind == "Marker":
        return Marker(_marker_id(message.get("id")))
    if kind == "Init":
        return Init()
    if kind == "OggOpus":
        raise ProtocolError("OggOpus audio is not supported here; send Audio messages")
    raise ProtocolError(f"unknown message type {kind[:40]!r}; expected Audio or Marker")


def _pcm(value: object) -> np.ndarray:
    if not isinstance(value, list):
        raise ProtocolError('Audio needs "pcm", a list of float samples')
    if not all(type(x) is float or type(x) is int for x in value):
        raise ProtocolError('Audio "pcm" must hold only numbers')
    pcm = np.array(value, dtype=np.float64)  # msgpack integers fit: 64 bits at most
    if not np.isfinite(pcm).all():
        raise ProtocolError('Audio "pcm" holds NaN or infinity')
    return pcm.astype(np.float32)


def _marker_id(value: object) -> int:
    if type(value) is not int or not _I64[0] <= value <= _I64[1]:
        raise ProtocolError('Marker needs "id", a 64-bit integer')
    return value


def _pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def ready() -> bytes:
    """Ready: the stream exists, audio may flow."""
    return _pack({"type": "Ready"})


def word(text: str, start_time: float) -> bytes:
    """Word: `text` began at `start_time` seconds of the client's audio."""
    return _pack({"type": "Word", "text": text, "start_time": float(start_time)})


def end_word(stop_time: float) -> bytes:
    """EndWord: the last Word ended at `stop_time` seconds."""
    return _pack({"type": "EndWord", "stop_time": float(stop_time)})


def step(step_idx: int, prs: Sequence[float], buffered_pcm: int) -> bytes:
    """Step: `step_idx` steps taken, each pause head's probability, samples not yet stepped."""
    probabilities = [float(p) for p in prs]
    return _pack(
        {"type": "Step", "step_idx": step_idx, "prs": probabilities, "buffered_pcm": buffered_pcm}
    )


def marker(marker_id: int) -> bytes:
    """Marker: the client's marker `marker_id`, echoed."""
    return _pack({"type": "Marker", "id": marker_id})


def error(message: str) -> bytes:
    """Error: why the server closes the connection (one line)."""
    return _pack({"type": "Error", "message": message})
