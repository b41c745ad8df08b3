"""An LLM's streamed text to words a TTS can say: `SpokenWords` cleans markdown and emoji and
hands out whole words only."""

from __future__ import annotations

import re

# Markdown that is written, not said: links keep their text, code marks, emphasis, headings,
# list bullets and quote marks go.
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_MARKS = re.compile(r"[*_`~#>|]+")
_BULLET = re.compile(r"(^|\n)\s*(?:[-+]|\d+[.)])\s+")
# Emoji and pictographs (the common blocks), variation selectors, zero-width joiners.
_EMOJI = re.compile(
    "[\U0001f000-\U0001faff\U00002600-\U000027bf\U0001f1e6-\U0001f1ff\U00002b00-\U00002bff"
    "\ufe0e\ufe0f\u200d\u20e3]+"
)
_SPACES = re.compile(r"\s+")


def clean_for_speech(text: str) -> str:
    """`text` without markdown marks or emoji, its whitespace runs made single spaces."""
    text = _LINK.sub(r"\1", text)
    text = _BULLET.sub(r"\1", text)
    text = _EMOJI.sub("", _MARKS.sub("", text))
    return _SPACES.sub(" ", text)


class SpokenWords:
    """Text pieces in (`add`), cleaned complete words out: a word is complete once a space
    follows it; `finish()` gives the last one. A markdown link or mark split across pieces
    is cleaned once whole (text is held back from an open `[` or `(` to its close)."""

    def __init__(self) -> None:
        self._pending = ""

    def add(self, piece: str) -> str:
        """The words `piece` completes, cleaned, each followed by one space ("" if none)."""
        self._pending += piece
        cut = _complete_end(self._pending)
        if cut == 0:
            return ""
        done, self._pending = self._pending[:cut], self._pending[cut:]
        words = clean_for_speech(done).strip()
        return words + " " if words else ""

    def finish(self) -> str:
        """The rest of the text, cleaned (the reply has ended)."""
        rest, self._pending = self._pending, ""
        return clean_for_speech(rest).strip()


def _complete_end(text: str) -> int:
    """Where the text's complete words end: after its last whitespace, unless a link's `[`
    or `(` opened before it is not closed yet (then before that)."""
    end = max(text.rfind(" "), text.rfind("\n"), text.rfind("\t")) + 1
    for opening, closing in (("[", "]"), ("(", ")")):
        at = text.rfind(opening, 0, end)
        if at >= 0 and text.find(closing, at) < 0:
            end = min(end, at)
    return end
