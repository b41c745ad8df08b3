"""Scripted parts for the assistant's tests: an STT that hears a word in every loud frame and
whose pause head says "done" on the others, and a TTS stream that plays `FRAMES_PER_WORD`
frames per pushed word. Both record the threads that step them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from moshi_mlx.stt.events import SttStep, WordStarted

FRAMES_PER_WORD = 3


class ScriptedStt:
    """A word (`u0`, `u1`, ...) for each frame louder than `loud_rms` (RMS), pause head 2
    "done" on the others; `hears` False: no word at all."""

    delay_steps = 2

    def __init__(self, hears: bool = True, loud_rms: float = 0.0):
        self.hears = hears
        self.loud_rms = loud_rms
        self.index = 0
        self.words = 0
        self.threads: set[int] = set()

    def step(self, pcm: np.ndarray) -> SttStep:
        self.threads.add(threading.get_ident())
        self.index += 1
        if self.hears and float(np.sqrt(np.mean(np.square(pcm)))) > self.loud_rms:
            self.words += 1
            word = WordStarted(f"u{self.words - 1}", self.index * 0.08)
            return SttStep(self.index, (word,), (0.0, 0.0, 0.01))
        return SttStep(self.index, (), (0.0, 0.0, 0.95))

    def finish_stream(self, stream: int) -> tuple:
        """Each word is reported at once: none is left open at the end of a flush."""
        return ()


@dataclass
class SpeechStep:
    pcm: list  # one frame (or None: waiting for words), as a TTS step's batch of one


class FrameSpeech:
    """`FRAMES_PER_WORD` copies of `frame` per pushed word; counts the frames it made."""

    def __init__(self, frame: np.ndarray):
        self.frame = frame
        self.queue: list[str] = []
        self.words: list[tuple[str, float]] = []
        self.frames = 0
        self.closed = False
        self.waiting = False
        self.threads: set[int] = set()

    def push(self, text: str) -> None:
        self.queue += text.split()

    def close(self) -> None:
        self.closed = True

    def steps(self):
        left = 0
        while True:
            self.threads.add(threading.get_ident())
            if left == 0 and self.queue:
                self.words.append((self.queue.pop(0), self.frames * 0.08))
                left = FRAMES_PER_WORD
            if left:
                left -= 1
                self.frames += 1
                self.waiting = False
                yield SpeechStep([self.frame.copy()])
            elif self.closed:
                return
            else:
                self.waiting = True
                yield SpeechStep([None])
