"""What every OpenAI route shares: errors in OpenAI's JSON shape, a bounded JSON body, the
`Authorization: Bearer` key check and the request fields' type checks.

OpenAI's error body is `{"error": {"message", "type", "param", "code"}}`; its clients raise
`BadRequestError` (400), `AuthenticationError` (401), `NotFoundError` (404) and so on from it.
A handler raises `ApiError` and `answers_api_errors` turns it into that response.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from moshi_mlx.serve import bodies
from moshi_mlx.serve.logtext import capped, without_paths

# A chat request carries the whole conversation: 2 MiB holds some 500k tokens of text.
MAX_JSON_BYTES = 2 * 1024 * 1024

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request an OpenAI route refuses: the HTTP status and OpenAI's error fields (the
    message without the server's file paths, `logtext.without_paths`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        message = without_paths(message)
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


# The OpenAI routes and the model each needs: without it, the route says which flag serves it.
_ROUTE_FLAGS = {
    "/v1/audio/transcriptions": "--stt",
    "/v1/audio/speech": "--tts",
    "/v1/audio/voices": "--tts",
    "/v1/realtime": "--stt",
}


def add_fallback_route(app: web.Application, key_allowed: Callable[[str | None], bool]) -> None:
    """Answer every `/v1` request no other route takes in OpenAI's error shape: 404 for a
    route not served (naming the flag that serves it), 405 for a method the route does not
    take. Mount it after every other route."""

    @answers_api_errors
    async def not_served(request: web.Request) -> web.Response:
        check_bearer_key(request, key_allowed)
        path, method = request.path, request.method
        methods = sorted(
            route.method
            for resource in request.app.router.resources()
            if resource.canonical == path
            for route in resource
            if route.method != "*"
        )
        if methods:
            message = f"{path} takes {', '.join(methods)}, not {capped(method, 10)}"
            raise ApiError(405, message, code="method_not_allowed")
        if flag := _ROUTE_FLAGS.get(path):
            raise ApiError(404, f"{path} is not served here: start the server with {flag}")
        raise ApiError(
            404, f"no such route: {capped(method, 10)} {capped(path)}", code="unknown_url"
        )

    app.router.add_route("*", "/v1/{tail:.*}", not_served)


def check_bearer_key(request: web.Request, key_allowed: Callable[[str | None], bool]) -> None:
    """Raise a 401 `ApiError` unless `Authorization: Bearer KEY` carries an allowed key."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not key_allowed(key.strip() if scheme.lower() == "bearer" else None):
        message = "a valid API key is needed (Authorization: Bearer KEY)"
        raise ApiError(401, message, code="invalid_api_key")


async def read_json_object(request: web.Request, max_bytes: int = MAX_JSON_BYTES) -> dict:
    """The request's body as a JSON object (`bodies.read_json_object`); its refusal as an
    `ApiError` (413 past `max_bytes`, 400 for anything else)."""
    try:
        return await bodies.read_json_object(request, max_bytes)
    except bodies.BadBody as exc:
        raise ApiError(exc.status, str(exc)) from None


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
