"""`moshi_mlx.errors.one_line`: how an exception's message reaches a client or a log line."""

from __future__ import annotations

from moshi_mlx.errors import ONE_LINE_CHARS, TtsError, one_line


def test_a_message_is_one_line_with_single_spaces():
    assert one_line(TtsError("bad\n  voice:\tfile\r\nx ")) == "bad voice: file x"


def test_a_long_message_is_capped():
    """A client's data in a message (a text, a file name) never goes out whole."""
    message = one_line(ValueError("word " * 10_000))
    assert len(message) == ONE_LINE_CHARS and "\n" not in message


def test_an_empty_message_is_the_type_name():
    assert one_line(KeyError()) == "KeyError"
    assert one_line(RuntimeError(" \n ")) == "RuntimeError"


def test_no_module_shortens_a_message_by_hand():
    """`one_line` is the one way a message is shortened (six hand-spelled copies before)."""
    import re
    from pathlib import Path

    package = Path(__file__).parents[2] / "moshi_mlx"
    by_hand = re.compile(r"""["']\s["']\.join\(str\(|str\(exc\)\.splitlines\(\)\[0\] if""")
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in package.rglob("*.py")
        if path.name != "errors.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if by_hand.search(line)
    ]
    assert not found, found
