"""What a streaming transcription reports, step by step (times in seconds of the input audio)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WordStarted:
    """A word was recognised; it began at `start`."""

    text: str
    start: float


@dataclass(frozen=True)
class WordEnded:
    """The last started word ended at `end`."""

    end: float


@dataclass(frozen=True)
class EndOfTurn:
    """The voice-activity heads say the speaker finished their turn, at `time`."""

    time: float


SttEvent = WordStarted | WordEnded | EndOfTurn


@dataclass(frozen=True)
class SttStep:
    """One 80 ms step of one stream: its index from the stream's start, the events it
    produced, each voice-activity head's probability that the speaker is done (empty when
    the checkpoint has no such heads), the text its token adds (for live captions, at
    once; a word's event comes when the word is known to be complete), and `text_token`, the
    token the model wrote (ids 0 and 3: padding; None while the model's delays fill)."""

    index: int
    events: tuple[SttEvent, ...] = ()
    pause_probabilities: tuple[float, ...] = ()
    text: str = ""
    text_token: int | None = None
