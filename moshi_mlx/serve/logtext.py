"""Client-supplied values in log lines, capped: a log line never carries a client's data whole."""

from __future__ import annotations

MAX_LOGGED_CHARS = 80


def capped(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """`value` as one printable line of at most `limit` characters (then "... (N chars)")."""
    text = str(value)
    size = len(text)
    shown = text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    shown = "".join(c if c.isprintable() else "?" for c in shown)
    return shown if size <= limit else f"{shown}... ({size} chars)"
