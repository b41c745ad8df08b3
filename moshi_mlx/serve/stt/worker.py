"""The transcription worker: every client's stream a row of one batch (`SttBatch`), stepped
in one compiled step per 80 ms frame on the server's `ModelThread` as one real-time job (a
`RealTimeClock`).

MLX keeps streams per thread (an array made on one thread cannot be evaluated on another),
so the batch lives on the model thread only. The event loop pushes each client's audio and
markers into its `Channel` and wakes the thread; results go back through the channel's
`deliver` callback (which the loop makes hop onto itself).

Pacing. A stream takes a row when its first whole frame is there (so a stream's audio
starts with its client's, as alone). Rows share one position, so a step feeds every busy row
a frame: its client's oldest whole frame, or 80 ms of silence when none came in time. The
batch steps as soon as
every *gating* row has a frame (a row gates once its last step was fed its client's audio; a
row that joined, or that heard silence last step, does not), and some row has something to
step. Failing that, it steps one frame period after the step would be due on time (the later
of the previous step plus one period and the oldest frame waiting), if some row has a frame:
a client whose audio is late by up to one period loses nothing, a later one hears silence
(counted per stream: `Channel.silent_steps`) and stops holding the others until its audio
comes back. A row in the model's silence prefix always has its frame (silence). A client
ahead of real time is stepped at the pace of the others; a batch with no gating row steps
as fast as the rows' audio allows, so audio that waits because the model is behind is
stepped back to back, as Kyutai's batched server does.

Markers follow Kyutai's rule: a marker comes back once the stream has stepped every whole
frame received before it, plus `delay_steps` more steps (the model's words lag its audio by
that many), so every word of the audio before the marker was reported first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moshi_mlx.errors import one_line
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import FRAME_SECONDS, ModelThread, RealTimeClock
from moshi_mlx.stt.batch import SttRowOutput
from moshi_mlx.stt.events import SttStep

log = logging.getLogger("moshi_mlx.stt")


class SttRows(Protocol):
    """Streams stepped together, as `moshi_mlx.stt.batch.SttBatch` (made on the model thread)."""

    delay_steps: int  # steps between a frame's audio and the words it yields

    @property
    def waiting(self) -> list[int]:
        """The busy rows whose next step needs a frame not pushed yet (not in the prefix)."""
        ...

    def add(self) -> int: ...

    def push(self, row: int, pcm: np.ndarray) -> None: ...

    def step(self) -> list[SttRowOutput]: ...

    def remove(self, row: int) -> None: ...


BatchFactory = Callable[[int], SttRows]  # rows -> an empty batch


@dataclass(frozen=True)
class Opened:
    """The stream exists: the client may be told it is ready."""


@dataclass(frozen=True)
class Stepped:
    """One step of the stream, and the samples still buffered after its frame."""

    step: SttStep
    buffered_pcm: int


@dataclass(frozen=True)
class MarkerReached:
    """Everything the audio before the client's marker `id` yields was delivered."""

    id: int


@dataclass(frozen=True)
class StreamFailed:
    """The stream cannot go on; the reason (one line) is for the client."""

    reason: str


StreamEvent = Opened | Stepped | MarkerReached | StreamFailed


class _Marker:
    def __init__(self, marker_id: int, frames: int, reached_at: int | None):
        self.id = marker_id
        self.frames = frames  # whole frames received before it
        self.reached_at = reached_at  # the step that took the last of them


class Channel:
    """One client's audio and markers on their way to its row, shared by the event loop
    (`push_audio`, `push_marker`, `close`) and the model thread (`take_frame`, `stepped`,
    `due_markers`)."""

    def __init__(self, deliver: Callable[[StreamEvent], None]):
        self.deliver = deliver
        self._lock = threading.Lock()
        self._chunks: deque[tuple[np.ndarray, float]] = deque()  # (samples, when received)
        self._buffered = 0
        self._received = 0  # samples since the start
        self._markers: deque[_Marker] = deque()
        self._frames_taken = 0
        self._steps = 0  # steps of the stream past its silence prefix
        self._last_taken_at = 0  # the step that took the latest frame
        self._closed = False
        self.silent_steps = 0  # steps that fed silence: the client's audio was late

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def received(self) -> int:
        """Samples received since the start."""
        return self._received

    def push_audio(self, pcm: np.ndarray) -> int:
        """Queue client samples (loop side); returns how many wait to be stepped now."""
        with self._lock:
            if pcm.size and not self._closed:
                self._chunks.append((pcm, time.monotonic()))
                self._buffered += pcm.size
                self._received += pcm.size
            return self._buffered

    def push_marker(self, marker_id: int) -> None:
        """Queue a marker after the audio pushed so far (loop side)."""
        with self._lock:
            frames = self._received // FRAME_SIZE
            reached = self._last_taken_at if frames <= self._frames_taken else None
            self._markers.append(_Marker(marker_id, frames, reached))

    def close(self) -> None:
        """Forget the buffered audio; the worker drops the stream."""
        with self._lock:
            self._closed = True
            self._chunks.clear()
            self._buffered = 0

    def frame_ready_at(self) -> float | None:
        """When the oldest whole frame was complete (a monotonic time), or None before one."""
        with self._lock:
            if self._buffered < FRAME_SIZE:
                return None
            needed = FRAME_SIZE
            for chunk, received_at in self._chunks:
                needed -= chunk.size
                if needed <= 0:
                    return received_at
            return None

    def take_frame(self) -> tuple[np.ndarray, int] | None:
        """(the oldest whole frame, samples left after it) for the next step, or None before
        a whole frame."""
        with self._lock:
            if self._buffered < FRAME_SIZE:
                return None
            parts, needed = [], FRAME_SIZE
            while needed:
                chunk, received_at = self._chunks.popleft()
                if chunk.size > needed:
                    self._chunks.appendleft((chunk[needed:], received_at))
                    chunk = chunk[:needed]
                parts.append(chunk)
                needed -= chunk.size
            self._buffered -= FRAME_SIZE
            self._frames_taken += 1
            self._last_taken_at = self._steps + 1
            for marker in self._markers:
                if marker.reached_at is None and marker.frames <= self._frames_taken:
                    marker.reached_at = self._last_taken_at
            return np.concatenate(parts), self._buffered

    def stepped(self, fed: bool) -> int:
        """The stream took a step past its prefix, fed its client's frame or silence; returns
        the samples still buffered."""
        with self._lock:
            self._steps += 1
            self.silent_steps += not fed
            return self._buffered

    def due_markers(self, delay_steps: int) -> list[int]:
        """The ids of the markers whose audio and delay the steps so far have covered."""
        with self._lock:
            due = []
            while self._markers:
                marker = self._markers[0]
                if marker.reached_at is None or marker.reached_at + delay_steps > self._steps:
                    break
                self._markers.popleft()
                due.append(marker.id)
            return due


@dataclass
class _Stream:
    row: int | None = None  # None until its first whole frame
    gating: bool = False  # its last step was fed its client's audio: the batch waits for it


class SttWorker(RealTimeClock):
    """The STT streams of a server, rows of one batch of `rows` (`batch_factory(rows)`), as
    one real-time job of `thread`: makes the batch on it and compiles its step, then adds,
    steps and drops the channels' rows. `ready` is set once streams can be opened, or `error`
    says why they cannot."""

    def __init__(self, batch_factory: BatchFactory, rows: int, thread: ModelThread):
        super().__init__()
        self._batch_factory = batch_factory
        self.rows = rows
        self.thread = thread
        # ("open" | "close", channel, when asked): appended on the loop, taken on the thread
        self._jobs: deque[tuple[str, Channel, float]] = deque()
        self._batch: SttRows | None = None  # model thread only
        self._streams: dict[Channel, _Stream] = {}  # model thread only
        self._last_step_at = 0.0
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.open_streams = 0  # written by the model thread only
        self.batch_steps = 0  # compiled steps taken (each one frame of every busy row)

    def start(self) -> None:
        """Make the batch and compile its step on the model thread, then step."""
        self.thread.call_soon(self._start_on_thread)

    def stop(self) -> None:
        """Drop every stream (after the step running now)."""
        self.thread.remove_realtime(self)
        self.thread.call_soon(self._streams.clear)

    def open(self, channel: Channel) -> None:
        """Open the channel's stream: it receives `Opened`; its row comes with its first whole
        frame (`StreamFailed` if none is free then)."""
        self._jobs.append(("open", channel, time.monotonic()))
        self.thread.wake()

    def notify(self) -> None:
        """A channel got audio or a marker."""
        self.thread.wake()

    def release(self, channel: Channel) -> None:
        """Close the channel and free its row."""
        channel.close()
        self._jobs.append(("close", channel, time.monotonic()))
        self.thread.wake()

    # --- model thread ---
    def _start_on_thread(self) -> None:
        try:
            self._batch = self._batch_factory(self.rows)
            _compile(self._batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            self.error = exc
        else:
            self.thread.add_realtime(self)
        finally:
            self.ready.set()

    def due_at(self) -> float | None:
        job = self._jobs[0][2] if self._jobs else None
        step = self._step_due_at()
        if job is None or (step is not None and step < job):
            return step
        return job

    def _step_due_at(self) -> float | None:
        """When the batch's next step is due (the module's pacing), or None: nothing to step."""
        if not self._streams:
            return None
        needing = set(self._batch.waiting)
        ready: list[float] = []  # when each row's frame was there
        gating_ready: list[float] = []
        missing = False  # a gating row without a frame
        for channel, stream in self._streams.items():
            if stream.row is not None and stream.row not in needing:  # in its silence prefix
                ready.append(self._last_step_at)
                continue
            at = channel.frame_ready_at()
            if at is not None:
                ready.append(at)
                if stream.gating:
                    gating_ready.append(at)
            elif stream.gating:
                missing = True
        if not ready:
            return None
        if not missing:
            return max(gating_ready) if gating_ready else min(ready)
        return max(self._last_step_at + FRAME_SECONDS, min(ready)) + FRAME_SECONDS

    def step(self) -> None:
        """Open and drop rows as asked, then, when due, one frame of every busy row."""
        self._apply_jobs()
        due = self._step_due_at()
        if due is not None and due <= time.monotonic():
            self._step_batch()

    def _apply_jobs(self) -> None:
        while self._jobs:
            action, channel, _ = self._jobs.popleft()
            if action == "close":
                stream = self._streams.pop(channel, None)
                if stream is not None and stream.row is not None:
                    self._batch.remove(stream.row)
            elif not channel.closed:
                self._streams[channel] = _Stream()
                _deliver(channel, Opened())
        self.open_streams = len(self._streams)

    def _add_rows(self) -> None:
        """A row for every stream whose first whole frame came."""
        for channel, stream in list(self._streams.items()):
            if stream.row is not None or channel.frame_ready_at() is None:
                continue
            try:
                stream.row = self._batch.add()
            except Exception as exc:  # noqa: BLE001 - reported to this client only
                del self._streams[channel]
                self.open_streams = len(self._streams)
                _deliver(channel, StreamFailed(f"cannot start a stream: {one_line(exc)}"))

    def _step_batch(self) -> None:
        """One frame of every busy row; its results, then the markers that came due."""
        self._add_rows()
        batch = self._batch
        needing = set(batch.waiting)
        fed: set[Channel] = set()
        for channel, stream in self._streams.items():
            if stream.row in needing and (taken := channel.take_frame()) is not None:
                batch.push(stream.row, taken[0])
                fed.add(channel)
        self._last_step_at = time.monotonic()
        try:
            outputs = {output.row: output for output in batch.step()}
        except Exception as exc:  # noqa: BLE001 - ends the batch's streams, not the server
            self._fail_all(f"the model failed: {one_line(exc)}")
            return
        self.batch_steps += 1
        for channel, stream in self._streams.items():
            if stream.row not in needing:
                continue  # no row yet, or in its silence prefix
            stream.gating = channel in fed
            buffered = channel.stepped(stream.gating)
            if (output := outputs.get(stream.row)) is not None:
                _deliver(channel, Stepped(output.step, buffered))
            for marker_id in channel.due_markers(batch.delay_steps):
                _deliver(channel, MarkerReached(marker_id))

    def _fail_all(self, reason: str) -> None:
        """The rows' state is unknown after a failed step: every stream ends (an idle batch
        starts again from nothing at its next row)."""
        streams, self._streams = self._streams, {}
        self.open_streams = 0
        for channel, stream in streams.items():
            if stream.row is not None:
                self._batch.remove(stream.row)
            _deliver(channel, StreamFailed(reason))


def _compile(batch: SttRows) -> None:
    """Step one row of silence until it reports (its prefix and one step), so that the first
    client does not wait for the step's compilation."""
    row = batch.add()
    try:
        while True:
            if row in batch.waiting:
                batch.push(row, np.zeros(FRAME_SIZE, np.float32))
            if batch.step():
                return
    finally:
        batch.remove(row)


def _deliver(channel: Channel, event: StreamEvent) -> None:
    try:
        channel.deliver(event)
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass
