"""Text pushed in pieces into a stream's text schedule: complete words go in as they arrive."""

from __future__ import annotations

from collections.abc import Callable

from moshi_mlx.tts.machine import Entry, TextSchedule

_BREAK_OPENING = "<break"


def last_word_end(text: str) -> int:
    """Where the text's complete words end: at its last whitespace outside a `<break .../>`
    tag, and before a tag that is not closed yet (0 if none). Other `<` and `>` are text."""
    end, index = 0, 0
    while index < len(text):
        char = text[index]
        if char == "<" and _BREAK_OPENING.startswith(text[index : index + len(_BREAK_OPENING)]):
            close = text.find(">", index)
            if close < 0:  # the tag's end has not come yet
                return end
            index = close
        elif char.isspace():
            end = index
        index += 1
    return end


class TextFeed:
    """One stream's text as it comes: `push(text)` adds words (a fragment may end
    mid-sentence; words are split on spaces as they arrive, the last one held until a space
    or `close` ends it), `close()` says the text is complete. `entries` turns text into the
    schedule's entries (`TtsModel.entries`), `main_speaker` is the token that opens the main
    speaker's turn: it is kept on the first word only."""

    def __init__(
        self, schedule: TextSchedule, entries: Callable[[str], list[Entry]], main_speaker: int
    ):
        self.schedule = schedule
        self._entries = entries
        self._main_speaker = main_speaker
        self._pending = ""  # the text after the last complete word
        self._started = False  # the first word (which carries the speaker token) is in

    def push(self, text: str) -> None:
        """Add text; complete words enter the schedule at once."""
        text = self._pending + text
        cut = last_word_end(text)
        self._pending = text[cut:]
        self._push_words(text[:cut])

    def close(self) -> None:
        """The text is complete."""
        self._push_words(self._pending)
        self._pending = ""
        self.schedule.close()

    def _push_words(self, text: str) -> None:
        entries = self._entries(text) if text.strip() else []
        first = next((i for i, entry in enumerate(entries) if entry.tokens), None)
        if self._started and first is not None:  # the same turn goes on: no speaker token
            word = entries[first]
            if word.tokens[0] == self._main_speaker:
                padding = max(0, word.padding - 1)
                entries[first] = Entry(word.tokens[1:], word.text, padding)
        self._started = self._started or first is not None
        self.schedule.push(entries)
