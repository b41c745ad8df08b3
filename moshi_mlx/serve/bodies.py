"""What a client sends, parsed under bounds, for every route: JSON bodies, msgpack messages,
websocket text and multipart fields.

Whatever arrives (nesting 100,000 deep, bad UTF-8, a body past its cap, a value of the wrong
type), parsing ends in `BadBody`, whose `status` (400 or 413) a route answers with, or whose
message a websocket protocol sends back as its error; never in the parser's own exception.

msgpack's limits cap each array, map, string and binary, but not how many containers a message
holds: 3.8 MB of nested empty arrays decodes into millions of Python lists (hundreds of MB).
`unpack_msgpack` also counts containers and stops at its bound.
"""

from __future__ import annotations

import json

import msgpack
from aiohttp import web

from moshi_mlx.errors import MoshiError

_READ_CHUNK = 64 * 1024


class ProtocolError(MoshiError):
    """A websocket message its protocol does not allow; the reason goes back to the client in
    the protocol's own error message (chat's 0x05, STT's and TTS's `Error`)."""


class BadBody(ValueError):
    """A client's body or message that its route does not take: the HTTP `status` to answer
    (400 malformed, 413 too large) and why, without the client's data."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


async def read_bytes(request: web.Request, max_bytes: int) -> bytes:
    """The request's body; a 413 `BadBody` past `max_bytes`, whatever the client announces
    (at most `max_bytes + 64 KiB` are read)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BadBody(f"the request body is over {max_bytes} bytes", 413)
    body = bytearray()
    while chunk := await request.content.read(_READ_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise BadBody(f"the request body is over {max_bytes} bytes", 413)
    return bytes(body)


def text_of(data: bytes, what: str = "the request body") -> str:
    """`data` as UTF-8 text; `BadBody` naming `what` if it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody(f"{what} is not UTF-8 text") from None


def json_value(data: bytes | str, what: str = "the request body") -> object:
    """`data` decoded as JSON; `BadBody` for text that is not UTF-8 JSON, or nests deeper than
    Python's recursion limit."""
    text = text_of(data, what) if isinstance(data, bytes) else data
    try:
        return json.loads(text)
    except RecursionError:
        raise BadBody(f"{what} is not valid JSON: it nests too deep") from None
    except ValueError:  # JSONDecodeError, and a str that is not valid Unicode
        raise BadBody(f"{what} is not valid JSON") from None


async def read_json_object(request: web.Request, max_bytes: int) -> dict:
    """The request's body as a JSON object: `read_bytes`, then `json_value`; a 400 `BadBody`
    for any other JSON value."""
    value = json_value(await read_bytes(request, max_bytes))
    if not isinstance(value, dict):
        raise BadBody("the request body must be a JSON object")
    return value


def unpack_msgpack(data: bytes, max_containers: int, **limits: int) -> object:
    """`msgpack.unpackb(data, raw=False, **limits)` that stops once the message has decoded
    more than `max_containers` arrays and maps (so memory stays bounded by the message's size);
    `BadBody` for anything that is not such a message (`str(exc)` says which limit it passed)."""
    decoded = 0

    def count(container):
        nonlocal decoded
        decoded += 1
        if decoded > max_containers:
            raise BadBody(f"more than {max_containers} arrays and maps in one message")
        return container

    try:
        return msgpack.unpackb(data, raw=False, list_hook=count, object_hook=count, **limits)
    except BadBody:
        raise
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise BadBody(f"not a msgpack message: {str(exc)[:100]}") from None
