"""The GA Realtime protocol's server events and objects as dicts, each with the fields the
`openai` package's types require: ids, conversation items, responses, errors."""

from __future__ import annotations

import secrets
from typing import Any


def new_id(prefix: str) -> str:
    """A fresh id: `prefix` ("event", "item", "resp", "sess") and 20 hex digits."""
    return f"{prefix}_{secrets.token_hex(10)}"


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event of type `kind` with a fresh `event_id`."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error(
    message: str,
    param: str | None = None,
    code: str | None = None,
    kind: str = "invalid_request_error",
    client_event_id: str | None = None,
) -> dict[str, Any]:
    """An `error` event (the session goes on)."""
    details = {"type": kind, "code": code, "message": message, "param": param}
    return event("error", error={**details, "event_id": client_event_id})


def user_audio_item(item_id: str, transcript: str | None, done: bool) -> dict[str, Any]:
    """The user's spoken message (its transcript once the turn is over)."""
    return _message(item_id, "user", [{"type": "input_audio", "transcript": transcript}], done)


def text_item(item_id: str, role: str, text: str) -> dict[str, Any]:
    """A text message of `role` ("user", "system", "assistant")."""
    kind = "output_text" if role == "assistant" else "input_text"
    return _message(item_id, role, [{"type": kind, "text": text}], True)


def answer_item(
    item_id: str, transcript: str | None, status: str, spoken: bool = True
) -> dict[str, Any]:
    """The assistant's answer, spoken (its transcript) or written (its text); no content
    until it is done."""
    part = {"type": "output_audio", "transcript": transcript}
    if not spoken:
        part = {"type": "output_text", "text": transcript}
    content = [] if transcript is None else [part]
    return {**_message(item_id, "assistant", content, True), "status": status}


def response(
    response_id: str,
    status: str,
    output: list[dict],
    voice: str,
    audio_format: dict,
    reason: str | None = None,
    modalities: list[str] | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A `realtime.response` object; `reason` for a cancelled one, `metadata` the client's."""
    details = None
    if status != "in_progress":
        details = {"type": status, "reason": reason, "error": None}
    return {
        "id": response_id,
        "object": "realtime.response",
        "conversation_id": None,
        "status": status,
        "status_details": details,
        "output": output,
        "output_modalities": modalities or ["audio"],
        "audio": {"output": {"format": audio_format, "voice": voice}},
        "max_output_tokens": "inf",
        "metadata": metadata,
        "usage": None,
    }


def _message(item_id: str, role: str, content: list[dict], done: bool) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": role,
        "status": "completed" if done else "in_progress",
        "content": content,
    }
