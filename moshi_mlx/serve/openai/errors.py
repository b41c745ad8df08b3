"""What every OpenAI route shares: errors in OpenAI's JSON shape, a bounded JSON body, the
`Authorization: Bearer` key check and the request fields' type checks.

OpenAI's error body is `{"error": {"message", "type", "param", "code"}}`; its clients raise
`BadRequestError` (400), `AuthenticationError` (401), `NotFoundError` (404) and so on from it.
A handler raises `ApiError` and `answers_api_errors` turns it into that response.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

# A chat request carries the whole conversation: 2 MiB holds some 500k tokens of text.
MAX_JSON_BYTES = 2 * 1024 * 1024
_READ_CHUNK = 64 * 1024

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request an OpenAI route refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error object: `{"error": {...}}`."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_OF_STATUS.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        """This error as a JSON response."""
        return web.json_response(self.body(), status=self.status)


Handler = Callable[..., Awaitable[web.StreamResponse]]


def answers_api_errors(handler: Handler) -> Handler:
    """Wrap a route handler (a function of the request, or a method): an `ApiError` it raises
    becomes OpenAI's error response."""

    @functools.wraps(handler)
    async def answer(*args: Any) -> web.StreamResponse:
        try:
            return await handler(*args)
        except ApiError as error:
            return error.response()

    return answer


def check_bearer_key(request: web.Request, key_allowed: Callable[[str | None], bool]) -> None:
    """Raise a 401 `ApiError` unless `Authorization: Bearer KEY` carries an allowed key."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not key_allowed(key.strip() if scheme.lower() == "bearer" else None):
        message = "a valid API key is needed (Authorization: Bearer KEY)"
        raise ApiError(401, message, code="invalid_api_key")


async def read_json_object(request: web.Request, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The request's body as a JSON object; 413 past `max_bytes`, 400 for anything that is
    not UTF-8 JSON holding an object. Reads at most `max_bytes + 1` bytes whatever the
    client announces."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"the request body is over {max_bytes} bytes")
    body = bytearray()
    while True:
        chunk = await request.content.read(_READ_CHUNK)
        if not chunk:
            break
        body += chunk
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes")
    try:
        value = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text") from None
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return value


def optional_number(
    body: dict, name: str, low: float, high: float, default: float | None = None
) -> float | None:
    """`body[name]` as a float in [low, high]; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be between {low} and {high}", name)
    return float(value)


def optional_int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    """`body[name]` as an int of at least `low` (and at most `high`); None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", name)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise ApiError(400, f"'{name}' must be {bound}", name)
    return value


def optional_bool(body: dict, name: str, default: bool = False) -> bool:
    """`body[name]` as a bool; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", name)
    return value


def optional_str(body: dict, name: str, max_chars: int = 256) -> str | None:
    """`body[name]` as a string of at most `max_chars`; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string", name)
    if len(value) > max_chars:
        raise ApiError(400, f"'{name}' is over {max_chars} characters", name)
    return value
