"""A deterministic stand-in for a speech-to-text stream (pure numpy), batched as `SttBatch`.

Step `i` of a stream reports, for a frame filled with one value `v`:
- a word every `word_every` steps (`i % word_every == 0`) named `s{i}:{round(v * 1000)}`
  (`torn` instead of the value if the frame is not all one value), starting at `i * 0.08` s;
  a frame of `v >= LOUD` pads it with `LONG_WORD_PADDING` letters (a flood of output);
- the end of that word two steps later;
- the end of a turn after `TURN_SILENT_STEPS` all-zero frames in a row;
- pause probabilities (0.1, 0.9), or none with `heads=False`.
A frame of `v == FAIL` makes the step raise.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from moshi_mlx.stt.batch import SttRowOutput
from moshi_mlx.stt.events import EndOfTurn, SttStep, WordEnded, WordStarted

FRAME_SIZE = 1920
STEP_SECONDS = 0.08
TURN_SILENT_STEPS = 3
LOUD = 0.9
FAIL = -0.5
LONG_WORD_PADDING = 8000
PAUSE_PROBABILITIES = (0.1, 0.9)


class FakeSttStream:
    """Words named after the step and the frame's value; see the module docstring."""

    frame_size = FRAME_SIZE

    def __init__(self, delay_steps: int = 2, word_every: int = 5, heads: bool = True):
        self.delay_steps = delay_steps
        self._word_every = word_every
        self._heads = heads
        self._index = 0
        self._silent_steps = 0
        self.threads: set[int] = set()

    def step(self, pcm: np.ndarray) -> SttStep:
        assert pcm.shape == (FRAME_SIZE,) and pcm.dtype == np.float32, (pcm.shape, pcm.dtype)
        self.threads.add(threading.get_ident())
        index, value = self._index, float(pcm[0])
        self._index += 1
        if value == FAIL:
            raise RuntimeError("the fake model\nfails on -0.5")
        events = []
        if index % self._word_every == 0:
            name = f"{round(value * 1000)}" if np.all(pcm == pcm[0]) else "torn"
            padding = "x" * LONG_WORD_PADDING if value >= LOUD else ""
            events.append(WordStarted(f"s{index}:{name}{padding}", index * STEP_SECONDS))
        if index % self._word_every == 2:
            events.append(WordEnded(index * STEP_SECONDS))
        self._silent_steps = 0 if pcm.any() else self._silent_steps + 1
        if self._silent_steps == TURN_SILENT_STEPS:
            events.append(EndOfTurn(index * STEP_SECONDS))
        heads = PAUSE_PROBABILITIES if self._heads else ()
        return SttStep(index, tuple(events), heads)


class FakeBatch:
    """`FakeSttStream`s as the rows of a batch like `SttBatch` (no silence prefix): a step
    feeds each busy row its pushed frame, or silence."""

    def __init__(self, factory: FakeFactory, rows: int):
        self._factory = factory
        self.rows = rows
        self.delay_steps = factory.options.get("delay_steps", 2)
        self._streams: dict[int, FakeSttStream] = {}
        self._frames: dict[int, deque[np.ndarray]] = {}

    @property
    def waiting(self) -> list[int]:
        return [row for row in sorted(self._streams) if not self._frames[row]]

    def add(self) -> int:
        row = next(row for row in range(self.rows) if row not in self._streams)
        self._streams[row] = self._factory.stream()
        self._frames[row] = deque()
        return row

    def push(self, row: int, pcm: np.ndarray) -> None:
        self._frames[row].append(pcm)

    def step(self) -> list[SttRowOutput]:
        silence = np.zeros(FRAME_SIZE, np.float32)
        outputs = []
        for row in sorted(self._streams):
            frames = self._frames[row]
            step = self._streams[row].step(frames.popleft() if frames else silence)
            outputs.append(SttRowOutput(row, step, False))
        return outputs

    def remove(self, row: int) -> None:
        del self._streams[row], self._frames[row]


class FakeFactory:
    """Makes `FakeBatch`es of `FakeSttStream`s and keeps the streams (to see which threads
    stepped them)."""

    def __init__(self, **options):
        self.options = options
        self.streams: list[FakeSttStream] = []
        self.threads: set[int] = set()

    def __call__(self, rows: int) -> FakeBatch:
        self.threads.add(threading.get_ident())
        return FakeBatch(self, rows)

    def stream(self) -> FakeSttStream:
        self.threads.add(threading.get_ident())
        stream = FakeSttStream(**self.options)
        self.streams.append(stream)
        return stream
