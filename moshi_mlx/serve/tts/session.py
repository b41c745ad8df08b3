"""One text-to-speech stream of the server: a real-time job of the `ModelThread`.

The event loop pushes the client's words (`push_text`, `end`); the model thread steps the
stream (`TtsModel.stream`) when it is due and hands audio frames and word timings back
through `deliver`. A stream is due at once until its first audio, then every 80 ms while
less than `ahead_seconds` of audio is out beyond real time; it is not due while the model
waits for words the client has not sent.

`TtsRun` steps a fixed batch whose rows cannot join or leave mid-run, so every stream is a
run of its own (batch 1); all of them step on the one model thread, each when due.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.serve.model_thread import FRAME_SECONDS, RealTimeClock
from moshi_mlx.tts.stepper import TtsSampling
from moshi_mlx.tts.synthesizer import TtsModel, TtsStep, TtsStream
from moshi_mlx.tts.voices import VOICE_TENSOR

AHEAD_SECONDS = 0.5  # audio a stream may have out beyond real time
log = logging.getLogger("moshi_mlx.serve.tts")


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
    client sent), the guidance and the sampling."""

    voice: Path | np.ndarray
    cfg_coef: float | None
    sampling: TtsSampling
    seed: int | None = None


class TtsSession(RealTimeClock):
    """A client's stream; see the module docstring."""

    def __init__(
        self,
        model: TtsModel,
        options: SessionOptions,
        deliver: Callable[[SessionEvent], None],
        ahead_seconds: float = AHEAD_SECONDS,
    ):
        super().__init__()
        self._model = model
        self._options = options
        self._deliver = deliver
        self._ahead = ahead_seconds
        self._inbox: deque[str | None] = deque()  # loop -> thread; None: the end of the text
        self._inbox_at = time.monotonic()
        self._created = time.monotonic()
        self._stream: TtsStream | None = None
        self._steps: Iterator[TtsStep] | None = None
        self._closed = False
        self._first_audio_at: float | None = None
        self._frames_out = 0
        self._words_sent = 0
        self.done = False
        self.first_audio_seconds: float | None = None  # from the first step to the first frame

    # --- event loop ---
    def push_text(self, text: str) -> None:
        self._inbox.append(text)
        self._inbox_at = time.monotonic()

    def end(self) -> None:
        self._inbox.append(None)
        self._inbox_at = time.monotonic()

    # --- model thread ---
    def due_at(self) -> float | None:
        if self.done:
            return None
        if self._inbox:
            return self._inbox_at
        if self._stream is None or (self._stream.waiting and not self._closed):
            return None
        if self._first_audio_at is None:
            return self._created
        return self._first_audio_at + self._frames_out * FRAME_SECONDS - self._ahead

    def step(self) -> None:
        if self._stream is None:
            self._stream = self._open()
            self._steps = self._stream.steps()
        while self._inbox:
            text = self._inbox.popleft()
            if self._closed:
                continue
            if text is None:
                self._stream.close()
                self._closed = True
            else:
                self._stream.push(text if text.endswith(" ") else text + " ")
        step = next(self._steps, None)
        if step is None:
            self._finish()
            return
        frame = step.pcm[0]
        if frame is not None:
            if self._first_audio_at is None:
                self._first_audio_at = time.monotonic()
                self.first_audio_seconds = self._first_audio_at - self._created
            self._frames_out += 1
            self._deliver(AudioFrame(frame))
        words = self._stream.words
        while self._words_sent + 1 < len(words):
            self._send_word(words, stop_s=words[self._words_sent + 1][1])
        if self._stream.run.finished:
            self._finish()

    def failed(self, exc: BaseException) -> None:
        self.done = True
        self._deliver(Failed(f"the model failed: {' '.join(str(exc).split())[:200]}"))

    def _open(self) -> TtsStream:
        voice = self._options.voice
        if isinstance(voice, np.ndarray):  # the client's embedding: a voice file of its own
            handle, name = tempfile.mkstemp(suffix=".safetensors")
            os.close(handle)
            try:
                mx.save_safetensors(name, {VOICE_TENSOR: mx.array(voice)})
                return self._stream_of(Path(name))
            finally:
                os.unlink(name)
        return self._stream_of(voice)

    def _stream_of(self, voice: Path) -> TtsStream:
        options = self._options
        stream = self._model.stream(voice, options.cfg_coef, options.sampling, options.seed)
        mx.eval(stream.run.stepper.condition, stream.run.stepper.cross)  # the voice is read now
        return stream

    def _send_word(self, words: list[tuple[str, float]], stop_s: float) -> None:
        text, start_s = words[self._words_sent]
        self._words_sent += 1
        self._deliver(WordSpoken(text, max(0.0, start_s), max(0.0, stop_s)))

    def _finish(self) -> None:
        words = self._stream.words if self._stream is not None else []
        end_s = self._frames_out * FRAME_SECONDS
        while self._words_sent < len(words):
            self._send_word(words, stop_s=end_s)
        self.done = True
        self._deliver(Finished())
