"""The assistant's two real-time jobs on the model thread: `ListenJob` (the STT, one step per
mic frame, and the flush) and `SpeakJob` (the TTS, kept a few frames ahead of the speaker)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import RealTimeClock
from moshi_mlx.stt.events import SttEvent, SttStep

# Mic frames the STT may fall behind before the oldest are dropped (2 s).
MAX_LISTEN_BACKLOG = 25
# Frames of the answer the TTS makes ahead of the speaker: enough to ride out an LLM step or
# a one-off call on the model thread; a barge-in drops them all at once.
SPEAK_AHEAD_FRAMES = 4


class Listener(Protocol):
    """A streaming STT (`moshi_mlx.stt.transcriber.SpeechToText`)."""

    delay_steps: int

    def step(self, pcm: np.ndarray) -> SttStep: ...
    def finish_stream(self, stream: int) -> tuple[SttEvent, ...]: ...


class SpeechStream(Protocol):
    """A streaming TTS (`moshi_mlx.tts.synthesizer.TtsStream`)."""

    words: list[tuple[str, float]]

    def push(self, text: str) -> None: ...
    def close(self) -> None: ...
    def steps(self) -> Iterator[Any]: ...

    @property
    def waiting(self) -> bool: ...


@dataclass(frozen=True)
class Heard:
    """What one STT step heard: the step, whether its mic frame was voiced, when the frame
    reached the app (monotonic s), and whether it ended a flush."""

    step: SttStep
    voiced: bool
    arrived: float
    flush_done: bool


class ListenJob(RealTimeClock):
    """STT steps: each mic frame as it comes (`push`), or first, after `flush(n)`, `n` frames
    of silence as fast as the model runs, the last of them with the words the STT still holds
    open (`finish_stream`: a word is complete only when the next begins); each step's `Heard`
    goes to `on_step` (on the model thread)."""

    def __init__(
        self,
        stt: Listener,
        on_step: Callable[[Heard], None],
        max_backlog: int = MAX_LISTEN_BACKLOG,
    ):
        super().__init__()
        self.stt = stt
        self._on_step = on_step
        self._max_backlog = max_backlog
        self._lock = threading.Lock()
        self._frames: deque[tuple[np.ndarray, bool, float]] = deque()
        self._flush_left = 0
        self._flush_asked = 0.0
        self._silence = np.zeros(FRAME_SIZE, np.float32)
        self.dropped_frames = 0

    def push(self, pcm: np.ndarray, voiced: bool, arrived: float) -> None:
        with self._lock:
            self._frames.append((pcm, voiced, arrived))
            while len(self._frames) > self._max_backlog:
                self._frames.popleft()
                self.dropped_frames += 1

    def clear(self) -> None:
        """Drop the mic frames not stepped yet."""
        with self._lock:
            self._frames.clear()

    def flush(self, steps: int) -> None:
        with self._lock:
            self._flush_left = max(1, steps)
            self._flush_asked = time.monotonic()

    def due_at(self) -> float | None:
        with self._lock:
            if self._flush_left:
                return self._flush_asked
            return self._frames[0][2] if self._frames else None

    def step(self) -> None:
        with self._lock:
            if self._flush_left:
                self._flush_left -= 1
                pcm, voiced, arrived, flush_done = self._silence, False, 0.0, not self._flush_left
            else:
                pcm, voiced, arrived = self._frames.popleft()
                flush_done = False
        step = self.stt.step(pcm)
        if flush_done:  # the words still open (the turn's last one) come out now
            step = replace(step, events=step.events + tuple(self.stt.finish_stream(0)))
        self._on_step(Heard(step, voiced, arrived, flush_done))


class SpeakJob(RealTimeClock):
    """TTS steps for the answer of the moment: words in (`push`, from any thread), frames
    out (`pop`, from the audio worker), at most `SPEAK_AHEAD_FRAMES` ahead; `stop` drops the
    answer at once. Each answer has a number (`open`); frames of an older one never come out.
    `on_frame()` (on the model thread) is told each time a frame is ready and when the
    answer's audio ends.
    """

    def __init__(self, on_frame: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._on_frame = on_frame
        self._lock = threading.Lock()
        self._speech: SpeechStream | None = None
        self._steps: Iterator[Any] | None = None
        self._answer = 0
        self._texts: deque[tuple[str, bool]] = deque()  # (words, close after them)
        self._frames: deque[np.ndarray] = deque()
        self._generated = False  # the TTS has ended the answer's audio
        self._changed = 0.0  # when words came or a frame went (a past time: due since)
        self.first_audio: dict[int, float] = {}  # answer -> monotonic time of its first frame
        self.words: list[tuple[str, float]] = []  # the answer's words and their start (s)

    @property
    def answer(self) -> int:
        return self._answer

    def open(self, speech: SpeechStream, answer: int) -> None:
        with self._lock:
            self._speech, self._steps, self._answer = speech, speech.steps(), answer
            self._texts.clear()
            self._frames.clear()
            self._generated = False
            self._changed = time.monotonic()
            self.words = []

    def push(self, text: str, close: bool = False) -> None:
        with self._lock:
            self._texts.append((text, close))
            self._changed = time.monotonic()

    def stop(self) -> None:
        with self._lock:
            self._speech = self._steps = None
            self._texts.clear()
            self._frames.clear()

    def pop(self) -> tuple[np.ndarray | None, bool, int]:
        """(the answer's next frame or None, whether the answer is over: its audio all made
        and taken, the answer's number)."""
        with self._lock:
            if self._frames:
                self._changed = time.monotonic()
                return self._frames.popleft(), False, self._answer
            return None, self._generated and self._speech is not None, self._answer

    def release(self) -> None:
        """The answer's end has been seen: no more stepping for it."""
        with self._lock:
            self._speech = self._steps = None

    def due_at(self) -> float | None:
        with self._lock:
            speech = self._speech
            if speech is None or self._generated or len(self._frames) >= SPEAK_AHEAD_FRAMES:
                return None
            if speech.waiting and not self._texts:
                return None
            return self._changed

    def step(self) -> None:
        with self._lock:
            speech, steps, answer = self._speech, self._steps, self._answer
            texts = list(self._texts)
            self._texts.clear()
        if speech is None or steps is None:
            return
        for text, close in texts:
            if text:
                speech.push(text)
            if close:
                speech.close()
        out = next(steps, None)
        with self._lock:
            if self._answer != answer or self._speech is None:
                return  # stopped meanwhile
            self.words = list(speech.words)
            frame = None if out is None else out.pcm[0]
            if out is None:
                self._generated = True
            elif frame is not None:
                self.first_audio.setdefault(answer, time.monotonic())
                self._frames.append(frame)
        if (out is None or frame is not None) and self._on_frame is not None:
            self._on_frame()
