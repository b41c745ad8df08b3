"""OpenAI's chat completion request, checked: `parse_chat_request(body) -> ChatRequest`.

Supported: `model`, `messages` (system, developer, user and assistant turns; text content or
text parts), `temperature`, `top_p`, `max_completion_tokens` (or the older `max_tokens`),
`stop`, `stream`, `stream_options.include_usage`, `n` = 1. Tools and other choices than one
are refused; other fields (seed, penalties, user, ...) are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from moshi_mlx.serve.openai.errors import (
    ApiError,
    optional_bool,
    optional_int,
    optional_number,
    optional_str,
)

MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_TOKENS_FIELD = 1_000_000  # beyond any context; the model's context bounds it further
# Roles as the chat templates know them (OpenAI's "developer" is the newer "system").
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat completion request."""

    model: str | None
    messages: list[dict[str, str]]
    temperature: float
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_chat_request(body: dict) -> ChatRequest:
    """Check OpenAI's fields; a 400 `ApiError` names the first wrong one."""
    if body.get("n") not in (None, 1):
        raise ApiError(400, "only one choice per request is supported ('n' must be 1)", "n")
    if body.get("tools"):
        raise ApiError(400, "tools are not supported", "tools")
    max_tokens = optional_int(body, "max_completion_tokens", 1, MAX_TOKENS_FIELD)
    if max_tokens is None:
        max_tokens = optional_int(body, "max_tokens", 1, MAX_TOKENS_FIELD)
    return ChatRequest(
        model=optional_str(body, "model"),
        messages=_messages(body.get("messages")),
        temperature=optional_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0, default=1.0),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop")),
        stream=optional_bool(body, "stream"),
        include_usage=_include_usage(body.get("stream_options")),
    )


def _messages(value: object) -> list[dict[str, str]]:
    if value is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    return [_message(item, f"messages[{i}]") for i, item in enumerate(value)]


def _message(item: object, where: str) -> dict[str, str]:
    if not isinstance(item, dict):
        raise ApiError(400, f"'{where}' must be an object", where)
    role = item.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        shown = repr(role)[:40] if isinstance(role, str) else "missing or not a string"
        raise ApiError(
            400, f"'{where}.role' must be system, developer, user or assistant: {shown}", where
        )
    content = item.get("content")
    if content is None and role == "assistant":
        content = ""
    return {"role": _ROLES[role], "content": _text(content, f"{where}.content")}


def _text(content: object, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"'{where}' must be a string or a list of text parts", where)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ApiError(400, f"'{where}' may hold text parts only", where)
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError(400, f"'{where}' has a text part without a string 'text'", where)
        texts.append(text)
    return "".join(texts)


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' may hold at most {MAX_STOPS} strings", "stop")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise ApiError(400, f"each 'stop' string must be at most {MAX_STOP_CHARS} characters")
    return tuple(stop for stop in stops if stop)


def _include_usage(options: object) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return optional_bool(options, "include_usage")
