"""Kyutai's chat protocol: binary websocket messages whose first byte says what they carry.

Every Kyutai client (its web client, `python -m moshi.client`, the Rust `moshi-cli`) speaks it:

| kind | name | payload |
| --- | --- | --- |
| 0x00 | handshake | protocol version and model version, u32 little endian each (both 0) |
| 0x01 | audio | Ogg Opus pages, 24 kHz mono; each direction is one Ogg stream |
| 0x02 | text | UTF-8 text: Moshi's word pieces, `▁` already turned into a space |
| 0x03 | control | one byte (start, end turn, pause, restart); unused in full duplex |
| 0x04 | metadata | UTF-8 JSON |
| 0x05 | error | UTF-8 reason, sent before the server closes the connection |
| 0x06 | ping | nothing; keeps a connection alive while no audio flows |

Kyutai's Python server sends a bare 0x00 as its handshake, its Rust server 0x00 plus eight
zero bytes; all its clients ignore the payload. We send the documented eight bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

from aiohttp import web

from moshi_mlx.chat.generate import ChatSampling
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.serve.bodies import ProtocolError
from moshi_mlx.serve.logtext import capped, without_paths
from moshi_mlx.serve.sessions import send_and_close

MAX_MESSAGE_BYTES = 64 * 1024  # an 80 ms Ogg Opus page is a few hundred bytes
_MAX_SEED = 2**63 - 1


class Kind(IntEnum):
    """The first byte of a message."""

    HANDSHAKE = 0x00
    AUDIO = 0x01
    TEXT = 0x02
    CONTROL = 0x03
    METADATA = 0x04
    ERROR = 0x05
    PING = 0x06


class ConversationEnded(Exception):
    """The server cannot go on with a conversation; the reason goes to the client as 0x05."""


async def refuse(ws: web.WebSocketResponse, reason: str) -> None:
    """Send the 0x05 error with the reason, and close."""
    await send_and_close(ws, error(reason))


def handshake() -> bytes:
    """The 0x00 message: protocol version 0, model version 0."""
    return bytes([Kind.HANDSHAKE]) + bytes(8)


def audio(ogg_pages: bytes) -> bytes:
    """0x01: Ogg Opus pages of 24 kHz mono audio."""
    return bytes([Kind.AUDIO]) + ogg_pages


def text(piece: str) -> bytes:
    """0x02: a piece of Moshi's text."""
    return bytes([Kind.TEXT]) + piece.encode("utf-8")


def metadata(data: Mapping) -> bytes:
    """0x04: JSON."""
    return bytes([Kind.METADATA]) + json.dumps(data).encode("utf-8")


def error(reason: str) -> bytes:
    """0x05: why the server closes the connection (no folder of the server's disk named)."""
    return bytes([Kind.ERROR]) + without_paths(reason).encode("utf-8")


def ping() -> bytes:
    """0x06: nothing but a sign of life."""
    return bytes([Kind.PING])


def parse(message: bytes) -> tuple[Kind, bytes]:
    """Split a client's message into its kind and payload; `ProtocolError` if it is invalid."""
    if not message:
        raise ProtocolError("empty message")
    if len(message) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"message of {len(message)} bytes is over the limit of {MAX_MESSAGE_BYTES} bytes"
        )
    try:
        kind = Kind(message[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind 0x{message[0]:02x}") from None
    return kind, bytes(message[1:])


@dataclass(frozen=True)
class SessionParams:
    """Sampling and seed of one conversation, from the server's flags and the URL's query."""

    sampling: ChatSampling  # the text's, then the audio's
    seed: int | None


def session_params(
    query: Mapping[str, str], defaults: ChatSampling, seed: int | None
) -> SessionParams:
    """Apply the query parameters that Kyutai's clients put on `/api/chat`.

    `text_temperature`, `text_topk`, `audio_temperature`, `audio_topk` replace the server's
    sampling flags. A conversation has one random stream, so one seed: `text_seed` if given,
    else `audio_seed`, else the server's `--seed` (else a fresh one). Other parameters
    (`pad_mult`, `repetition_penalty`, ...) have no counterpart and are ignored.
    """
    text, audio = defaults
    sampling = (
        Sampling(
            _number(query, "text_temperature", text.temp), _count(query, "text_topk", text.top_k)
        ),
        Sampling(
            _number(query, "audio_temperature", audio.temp),
            _count(query, "audio_topk", audio.top_k),
        ),
    )
    for name in ("text_seed", "audio_seed"):
        if name in query:
            seed = _count(query, name, 0, upper=_MAX_SEED)
            break
    return SessionParams(sampling, seed)


def _number(query: Mapping[str, str], name: str, default: float) -> float:
    if name not in query:
        return default
    try:
        value = float(query[name])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ProtocolError(
            f"query parameter {name} must be a number >= 0, got {capped(repr(query[name]))}"
        )
    return value


def _count(query: Mapping[str, str], name: str, default: int, upper: int = 1 << 20) -> int:
    if name not in query:
        return default
    raw = query[name]
    try:
        value = int(raw)
    except ValueError:
        value = _whole_float(raw)
    if not 0 <= value <= upper:
        raise ProtocolError(
            f"query parameter {name} must be a whole number from 0 to {upper}, "
            f"got {capped(repr(raw))}"
        )
    return value


def _whole_float(raw: str) -> int:
    """`raw` as an int if it is a float with no fraction ("25.0"), else -1."""
    try:
        value = float(raw)
    except ValueError:
        return -1
    return int(value) if value.is_integer() else -1
