"""Client-supplied values in log lines, capped: a log line never carries a client's data whole;
and messages to clients without the server's file paths."""

from __future__ import annotations

import re

MAX_LOGGED_CHARS = 80


def capped(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """`value` as one printable line of at most `limit` characters (then "... (N chars)")."""
    text = str(value)
    size = len(text)
    shown = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    shown = "".join(c if c.isprintable() else "?" for c in shown)
    return shown if size <= limit else f"{shown}... ({size} chars)"


# An absolute file path (or ~/...) standing alone in a message; not a route (/v1/..., /api/...)
# nor the path part of a URL (which follows a host name).
_FILE_PATH = re.compile(r"(?<![\w.:/~-])~?/(?!(?:v1|api|assistant)\b)[^\s'\"`,;()<>]+")


def without_paths(message: str) -> str:
    """`message` with each file path of the server's disk cut to its last name
    (`/Users/me/models/x.safetensors` -> `.../x.safetensors`): what a client is told names no
    folder of the server."""

    def last_name(match: re.Match) -> str:
        name = match.group(0).rstrip("/").rsplit("/", 1)[-1]
        return f".../{name}" if name else "..."

    return _FILE_PATH.sub(last_name, message)
