"""One text-to-speech stream of the server, as its route sees it: `TtsSession`.

The event loop pushes the client's words (`push_text`, `end`); the stream is a row of one of
the batches of `moshi_mlx.serve.tts.streams.TtsStreams` (the real-time job of the model
thread), which hands its audio frames, word timings and end back through `deliver`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moshi_mlx.runtime.model_thread import FRAME_SECONDS
from moshi_mlx.runtime.sampling import Sampling

AHEAD_SECONDS = 0.5  # audio a stream may have out beyond real time


@dataclass(frozen=True)
class AudioFrame:
    pcm: np.ndarray  # (1920,) float32


@dataclass(frozen=True)
class WordSpoken:
    text: str
    start_s: float
    stop_s: float


@dataclass(frozen=True)
class Finished:
    """The text was spoken to its end."""


@dataclass(frozen=True)
class Failed:
    reason: str  # one line, for the client


SessionEvent = AudioFrame | WordSpoken | Finished | Failed


@dataclass(frozen=True)
class SessionOptions:
    """How a stream speaks: the voice (a voice file, or an embedding (1, dim, frames) the
    client sent; None: a model without voice embeddings, which speaks its prefix's), the guidance and the sampling (`seed` seeds the batch the stream starts;
    beside other streams its draws depend on theirs), and the audio prefix of a cloned
    voice (`TtsRequest.prefix`; None: none)."""

    voice: Path | np.ndarray | None
    cfg_coef: float | None
    sampling: tuple[Sampling, Sampling]  # the text's, then the audio's
    seed: int | None = None
    prefix: np.ndarray | None = None


class TtsSession:
    """A client's stream: its text in (`push_text`, `end`, on the event loop), its events
    out (`deliver`, from the model thread), and what the model thread knows of its row."""

    def __init__(self, options: SessionOptions, deliver: Callable[[SessionEvent], None]):
        self.options = options
        self._deliver = deliver
        self._lock = threading.Lock()
        self._inbox: deque[str | None] = deque()  # loop -> thread; None: the end of the text
        self.text_at = time.monotonic()  # when text last arrived
        self.created = time.monotonic()
        # --- model thread ---
        self.row: int | None = None
        self.closed = False  # the end of the text reached the model
        self.first_audio_at: float | None = None
        self.frames_out = 0
        self.done = False
        self.first_audio_seconds: float | None = None  # from its start to the first frame
        self._words_sent = 0

    # --- event loop ---
    def push_text(self, text: str) -> None:
        with self._lock:
            self._inbox.append(text)
            self.text_at = time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._inbox.append(None)
            self.text_at = time.monotonic()

    # --- model thread ---
    @property
    def has_text(self) -> bool:
        """Whether text (or its end) waits to reach the model."""
        return bool(self._inbox)

    def take_text(self) -> list[str | None]:
        """The text pushed since the last call, words ending in a space (None: the end)."""
        with self._lock:
            items, self._inbox = list(self._inbox), deque()
        return [item if item is None or item.endswith(" ") else item + " " for item in items]

    def due_at(self, waiting: bool, ahead: float) -> float | None:
        """When the row's next step is due: at once until its first audio, then while less
        than `ahead` seconds of audio are out beyond real time; None when it `waiting` for
        words not sent yet (or is done)."""
        if self.done or (waiting and not self.closed):
            return None
        if self.first_audio_at is None:
            return self.created
        return self.first_audio_at + self.frames_out * FRAME_SECONDS - ahead

    def audio(self, pcm: np.ndarray) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            self.first_audio_seconds = self.first_audio_at - self.created
        self.frames_out += 1
        self._deliver(AudioFrame(pcm))

    def words(self, words: list[tuple[str, float]]) -> None:
        """The words spoken so far with their start times: each goes out once the next one
        started (its stop time)."""
        while self._words_sent + 1 < len(words):
            self._send_word(words, stop_s=words[self._words_sent + 1][1])

    def finish(self, words: list[tuple[str, float]]) -> None:
        """The speech ended: the words left (stopping with the audio), then `Finished`."""
        end_s = self.frames_out * FRAME_SECONDS
        while self._words_sent < len(words):
            self._send_word(words, stop_s=end_s)
        self.done = True
        self._deliver(Finished())

    def fail(self, reason: str) -> None:
        self.done = True
        self._deliver(Failed(reason))

    def _send_word(self, words: list[tuple[str, float]], stop_s: float) -> None:
        text, start_s = words[self._words_sent]
        self._words_sent += 1
        self._deliver(WordSpoken(text, max(0.0, start_s), max(0.0, stop_s)))
