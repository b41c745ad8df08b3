"""STT streams that come and go, stepped together: one compiled step for up to `rows` streams.

    batch = SttBatch(model, rows=8)   # from the model thread of a server
    row = batch.add()                 # a free row; its silence prefix starts at the next step
    batch.push(row, pcm)              # float32 (1920,) frames (or (n, 1920)) as they come
    for out in batch.step():          # one frame of every busy row
        out.step.events               # words with times, ends of turn (as `SpeechToText`)
        if out.finished: batch.remove(out.row)
    batch.close(row)                  # its audio ended: flushed, then finished

As `moshi_mlx.tts.batch.TtsBatch`, rows run at one global position and each remembers where
its stream started (`KVRing.starts`): a row attends only to what it wrote since, its token
ring row starts empty and its own step count decides its start tokens, so a stream's text is
the text it gets alone (`SpeechToText` with one stream), up to float rounding (greedy: the
same tokens; tested). Each row encodes its audio with its own Mimi state (a batch of one:
Mimi's caches keep one position per batch), all evaluated together with the LM step.

A row starts with the model's silence prefix (fed by the batch; frames pushed meanwhile
wait), and its first step after it reports the prefix's words, as `SpeechToText` does. A busy
row whose client has pushed no frame for a step hears silence in that step: a server that
wants each stream's audio unbroken steps when `waiting` is empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import AudioError
from moshi_mlx.runtime.batch_rows import BatchRows
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.stt.events import SttEvent, SttStep
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.stt.transcriber import (
    FLUSH_EXTRA_SECONDS,
    FRAME_SECONDS,
    StreamReader,
    SttModel,
    done_probabilities,
    joined_steps,
)


@dataclass(frozen=True)
class SttRowOutput:
    """A busy row's step once its silence prefix is over: its `SttStep` (the first one with
    the prefix's words), and `finished`: it was closed and its last words are out (remove
    the row)."""

    row: int
    step: SttStep
    finished: bool


class _SttRow:
    """A busy row: its frames waiting, its encoder, its reader, the step its stream is at."""

    def __init__(self, model: SttModel, prefix_steps: int):
        self.frames: deque[np.ndarray] = deque()
        self.encoder = model.codec.batch_encoder(1)
        self.reader = StreamReader(model)
        self.prefix_left = prefix_steps
        self.carried: list[SttStep] = []  # the prefix's steps, reported with the first after
        self.step = 0
        self.closed = False


class SttBatch:
    """Up to `rows` STT streams stepped together; `add` a stream to a free row, `push` its
    audio, `step` every busy row, `close` it when its audio ends, `remove` it when finished
    (or given up)."""

    def __init__(self, model: SttModel, rows: int, text_sampling: Sampling | None = None):
        self._busy: BatchRows[_SttRow] = BatchRows(rows)
        self.model = model
        self.rows = rows
        self._stepper = SttStepper(
            model.lm, rows, text_sampling, compiled_steps=model.compiled_steps
        )
        timing = model.lm.config.stt_config
        seconds = timing.audio_delay_seconds + FLUSH_EXTRA_SECONDS
        self.flush_steps = int(np.ceil(seconds / FRAME_SECONDS))  # as `SpeechToText`'s
        # Steps between a frame's audio and the words it yields (as `SpeechToText`'s).
        self.delay_steps = int(np.ceil(timing.audio_delay_seconds / FRAME_SECONDS))

    @property
    def busy_rows(self) -> list[int]:
        """The rows that hold a stream, in order."""
        return sorted(self._busy)

    @property
    def waiting(self) -> list[int]:
        """The busy rows whose next step needs a frame not pushed yet."""
        return [
            row
            for row, busy in self._busy.items()
            if not busy.prefix_left and not busy.frames and not busy.closed
        ]

    def add(self) -> int:
        """Start a stream in a free row at the next step; returns the row."""
        if not self._busy:
            self._stepper.reset()  # an idle batch starts again at position 0
        row = self._busy.free_row()
        self._stepper.start_row(row)
        self._busy[row] = _SttRow(self.model, self.model.silence_prefix_steps)
        return row

    def push(self, row: int, pcm: np.ndarray) -> None:
        """Frames of `row`'s audio, (1920,) or (n, 1920) float32 at 24 kHz."""
        busy = self._busy.stream(row)
        if busy.closed:
            raise AudioError(f"row {row}'s audio was closed")
        frames = np.asarray(pcm, np.float32)
        if frames.shape[-1:] != (FRAME_SIZE,) or frames.ndim not in (1, 2):
            raise AudioError(f"expected frames of {FRAME_SIZE} samples, got {frames.shape}")
        busy.frames.extend(frames.reshape(-1, FRAME_SIZE))

    def close(self, row: int) -> None:
        """`row`'s audio is over: its frames, then `flush_steps` of silence, bring out its
        last words, and the step after them says it `finished`."""
        busy = self._busy.stream(row)
        busy.frames.extend(np.zeros((self.flush_steps, FRAME_SIZE), np.float32))
        busy.closed = True

    def remove(self, row: int) -> None:
        """Free `row`; it costs nothing to the others."""
        self._busy.release(row)

    def step(self) -> list[SttRowOutput]:
        """One frame of every busy row (silence for a row in its prefix or with no frame
        pushed); the outputs of the rows past their prefix."""
        if not self._busy:
            return []
        silence = np.zeros(FRAME_SIZE, np.float32)
        codes = [mx.zeros(self.model.lm.config.n_q, mx.int32)] * self.rows
        for row, busy in self._busy.items():
            fed = busy.frames.popleft() if busy.frames and not busy.prefix_left else silence
            codes[row] = busy.encoder.encode_frames(fed[None])[0]
        out = self._stepper.step(mx.stack(codes))
        encoders = [busy.encoder.state for busy in self._busy.values()]
        mx.eval(out.text, out.head_probabilities, encoders)
        tokens = np.array(out.text).tolist()
        heads = done_probabilities(out.head_probabilities)
        return [
            output
            for row in self.busy_rows
            if (output := self._row_output(row, tokens[row], heads[row])) is not None
        ]

    def _row_output(self, row: int, token: int, heads: np.ndarray) -> SttRowOutput | None:
        busy = self._busy[row]
        index = busy.step
        busy.step += 1
        if busy.step > self.model.lm.config.max_delay:
            step = busy.reader.read(index, token, heads)
        else:
            step = SttStep(index)
        if busy.prefix_left:
            busy.prefix_left -= 1
            busy.carried.append(step)
            return None
        if busy.carried:
            step = joined_steps([*busy.carried, step])
            busy.carried = []
        finished = busy.closed and not busy.frames
        if finished:
            last: tuple[SttEvent, ...] = busy.reader.timer.finish()
            step = replace(step, events=step.events + last)
        return SttRowOutput(row, step, finished)
