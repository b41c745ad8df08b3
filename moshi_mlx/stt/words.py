"""Words with start and end times from the speech-to-text model's text tokens, one step at a
time, with the times Kyutai's file-transcription script derives from the same tokens.

The model writes one text token per 80 ms step: a word's pieces, padding (3) while nothing new
is said, and an end-of-padding token (0) just before each word. A *segment* runs from the step
after one end-of-padding token to the next one. Its pieces are decoded and split on spaces:

- one word: it spans the whole segment;
- several words (said too fast for a boundary between them): each but the last spans as many
  steps as the tokenizer gives it pieces, from the segment's start on, and the last one takes
  what remains up to the segment's end;
- the segment still open when the stream ends: it ends at the first end-of-stream token in it,
  else one second after its start or at the end of the stream, whichever comes first;
- tokens before the first end-of-padding token belong to no segment and are dropped.

A step's time is its index / 12.5 minus the audio delay and the silence before the audio,
clipped at 0. Words are reported once nothing later can change them: when the next word of the
segment starts, when the segment closes, or at `finish()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from moshi_mlx.runtime.tokenizer import TextTokenizer
from moshi_mlx.stt.events import SttEvent, WordEnded, WordStarted


class Word(NamedTuple):
    """A finished word: its text and its start and end in seconds of the input audio."""

    text: str
    start: float
    end: float


class WordTimer:
    """Turns one stream's `(step index, text token)` pairs into `WordStarted`/`WordEnded`
    events, each start directly followed by its end. Steps are indexed from the stream's
    start, silence prefix included; `finish()` ends the stream and readies the timer for
    another."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        audio_delay: float,
        silence_prefix: float,
        frame_period: float = 0.08,
        padding_id: int = 3,
        end_of_padding_id: int = 0,
    ):
        self.tokenizer = tokenizer
        self.padding_id = padding_id
        self.end_of_padding_id = end_of_padding_id
        self._eos_id = tokenizer.eos_id()
        self._vocabulary = tokenizer.get_piece_size()  # larger ids (a mismatched model): no text
        self._frame_rate = 1.0 / frame_period  # steps per second
        self._offset = silence_prefix + audio_delay
        self.reset()

    def reset(self) -> None:
        """Forget the stream so far."""
        self._steps = 0  # steps seen: the next step index is at least this
        self._segment_start: int | None = None  # None until the first end-of-padding token
        self._segment_tokens: list[tuple[int, int]] = []  # (step, text token)
        self._segment_eos: int | None = None  # step of the segment's first end-of-stream token
        self._reported = 0  # words of the segment already reported
        self._cursor = 0  # step where the segment's next unreported word starts

    def push(self, step_index: int, text_token: int) -> tuple[SttEvent, ...]:
        """Take the model's text token for one step; return the words it finished."""
        if step_index < self._steps:
            raise ValueError(f"step {step_index} comes after step {self._steps - 1}")
        self._steps = step_index + 1
        if text_token == self.end_of_padding_id:
            events = self._close(step_index) if self._segment_start is not None else ()
            self._open(step_index + 1)
            return events
        if self._segment_start is None:
            return ()
        if text_token == self._eos_id:
            if self._segment_eos is None:
                self._segment_eos = step_index
        elif self.padding_id < text_token < self._vocabulary:
            self._segment_tokens.append((step_index, text_token))
            return self._report_settled()
        return ()

    def finish(self) -> tuple[SttEvent, ...]:
        """End the stream: report the words of its last segment, then `reset()`."""
        events: tuple[SttEvent, ...] = ()
        if self._segment_start is not None:
            events = self._close(self._last_segment_end())
        self.reset()
        return events

    def _open(self, start: int) -> None:
        self._segment_start = start
        self._segment_tokens = []
        self._segment_eos = None
        self._reported = 0
        self._cursor = start

    def _last_segment_end(self) -> float:
        """Where the stream's last segment ends, in steps (may fall between two steps)."""
        if self._segment_eos is not None:
            return self._segment_eos
        return min(self._steps, self._segment_start + self._frame_rate)  # at most 1 s long

    def _words(self, before: float) -> list[str]:
        """The segment's words decoded from its text tokens before step `before`."""
        ids = [token for step, token in self._segment_tokens if step < before]
        return self.tokenizer.decode(ids).split()

    def _report_settled(self) -> tuple[SttEvent, ...]:
        """Report the words a later word of the segment has settled: those before it, when
        it falls where the segment would still reach were the stream to end now."""
        certain_end = self._segment_start + self._frame_rate
        if self._segment_eos is not None:
            certain_end = min(certain_end, self._segment_eos)
        words = self._words(certain_end)
        events: list[SttEvent] = []
        for text in words[self._reported : -1]:
            events += self._report(text)
        return tuple(events)

    def _close(self, end: float) -> tuple[SttEvent, ...]:
        """Report the segment's remaining words; the last ends at step `end`."""
        words = self._words(end)[self._reported :]
        events: list[SttEvent] = []
        for text in words[:-1]:
            events += self._report(text)
        if words:
            events += [WordStarted(words[-1], self._time(self._cursor)), WordEnded(self._time(end))]
        return tuple(events)

    def _report(self, text: str) -> tuple[WordStarted, WordEnded]:
        """A word followed by another in its segment: it spans one step per piece."""
        start = self._cursor
        self._cursor += len(self.tokenizer.encode(text))
        self._reported += 1
        return WordStarted(text, self._time(start)), WordEnded(self._time(self._cursor))

    def _time(self, step: float) -> float:
        return max(0.0, step / self._frame_rate - self._offset)


def finished_words(events: Iterable[SttEvent]) -> list[Word]:
    """The words of an event sequence: each `WordStarted` with the `WordEnded` after it
    (other events are skipped; a word never ended is left out)."""
    words: list[Word] = []
    started: WordStarted | None = None
    for event in events:
        if isinstance(event, WordStarted):
            started = event
        elif isinstance(event, WordEnded) and started is not None:
            words.append(Word(started.text, started.start, event.end))
            started = None
    return words
