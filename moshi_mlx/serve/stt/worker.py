"""The transcription worker: every client's stream, made, stepped and dropped on the server's
`ModelThread` as one real-time job (a `RealTimeClock`).

MLX keeps streams per thread (an array made on one thread cannot be evaluated on another),
so streams live on the model thread only. The event loop pushes each client's audio and
markers into its `Channel` and wakes the thread; the job is due as soon as a stream has a
whole frame buffered (or a stream is to be opened or dropped), and each step takes one frame
of every stream that has one, as Kyutai's batched server does; a client whose audio arrived
faster than it is stepped is simply stepped again at once. Results go back through the
channel's `deliver` callback (which the loop makes hop onto itself).

Markers follow Kyutai's rule: a marker comes back once the stream has stepped every whole
frame received before it, plus `delay_steps` more (the model's words lag its audio by that
many steps), so every word of the audio before the marker was reported first.
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

from moshi_mlx.serve.model_thread import ModelThread, RealTimeClock
from moshi_mlx.stt.events import SttStep

log = logging.getLogger("moshi_mlx.stt")


class SttStream(Protocol):
    """One client's transcription state (made by the stream factory on the worker thread)."""

    frame_size: int  # samples at 24 kHz per step (1920: 80 ms)
    delay_steps: int  # steps between a frame's audio and the words it yields

    def step(self, pcm: np.ndarray) -> SttStep:
        """Transcribe one frame: (frame_size,) float32 mono samples."""
        ...


StreamFactory = Callable[[], SttStream]


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
class Failed:
    """The stream cannot go on; the reason (one line) is for the client."""

    reason: str


StreamEvent = Opened | Stepped | MarkerReached | Failed


class Channel:
    """One client's audio and markers on their way to its stream, shared by the event loop
    (`push_audio`, `push_marker`, `close`) and the model thread (`take_frame`, `due_markers`)."""

    def __init__(self, deliver: Callable[[StreamEvent], None]):
        self.deliver = deliver
        self._lock = threading.Lock()
        self._chunks: deque[tuple[np.ndarray, float]] = deque()  # (samples, when received)
        self._buffered = 0
        self._received = 0  # samples since the start
        self._markers: deque[tuple[int, int]] = deque()  # (samples received before it, id)
        self._closed = False

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
            self._markers.append((self._received, marker_id))

    def close(self) -> None:
        """Forget the buffered audio; the worker drops the stream."""
        with self._lock:
            self._closed = True
            self._chunks.clear()
            self._buffered = 0

    def frame_ready_at(self, frame_size: int) -> float | None:
        """When the oldest whole frame was complete (a monotonic time), or None before one."""
        with self._lock:
            if self._buffered < frame_size:
                return None
            needed = frame_size
            for chunk, received_at in self._chunks:
                needed -= chunk.size
                if needed <= 0:
                    return received_at
            return None

    def take_frame(self, frame_size: int) -> tuple[np.ndarray, int] | None:
        """(the oldest whole frame, samples left after it), or None before a whole frame."""
        with self._lock:
            if self._buffered < frame_size:
                return None
            parts, needed = [], frame_size
            while needed:
                chunk, received_at = self._chunks.popleft()
                if chunk.size > needed:
                    self._chunks.appendleft((chunk[needed:], received_at))
                    chunk = chunk[:needed]
                parts.append(chunk)
                needed -= chunk.size
            self._buffered -= frame_size
            return np.concatenate(parts), self._buffered

    def due_markers(self, steps_done: int, frame_size: int, delay_steps: int) -> list[int]:
        """The ids of the markers whose audio and delay `steps_done` steps have covered."""
        with self._lock:
            due = []
            while self._markers:
                received, marker_id = self._markers[0]
                if received // frame_size + delay_steps > steps_done:
                    break
                self._markers.popleft()
                due.append(marker_id)
            return due


@dataclass
class _Active:
    stream: SttStream
    steps_done: int = 0


class SttWorker(RealTimeClock):
    """The STT streams of a server as one real-time job of `thread` (a thread of its own
    when None): runs `warm_up` (if any) on it, then makes, steps and drops the channels'
    streams. `ready` is set once streams can be opened, or `error` says why they cannot."""

    def __init__(
        self,
        stream_factory: StreamFactory,
        warm_up: Callable[[], None] | None = None,
        thread: ModelThread | None = None,
    ):
        super().__init__()
        self._stream_factory = stream_factory
        self._warm_up = warm_up
        self._owns_thread = thread is None
        self.thread = thread or ModelThread("moshi-stt")
        # ("open" | "close", channel, when asked): appended on the loop, taken on the thread
        self._jobs: deque[tuple[str, Channel, float]] = deque()
        self._streams: dict[Channel, _Active] = {}  # model thread only
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.open_streams = 0  # written by the model thread only

    def start(self) -> None:
        """Warm up on the model thread (started here if it is the worker's own), then step."""
        if self._owns_thread:
            self.thread.start()
        self.thread.call_soon(self._start_on_thread)

    def stop(self, timeout: float | None = None) -> None:
        """Drop every stream (after the step running now) and, if it is its own, end the
        thread. `timeout` is accepted for compatibility; the thread ends after one step."""
        self.thread.remove_realtime(self)
        if self._owns_thread:
            self.thread.stop()
        else:
            self.thread.call_soon(self._streams.clear)

    def open(self, channel: Channel) -> None:
        """Make the channel's stream; the channel receives `Opened` or `Failed`."""
        self._jobs.append(("open", channel, time.monotonic()))
        self.thread.wake()

    def notify(self) -> None:
        """A channel got audio or a marker."""
        self.thread.wake()

    def release(self, channel: Channel) -> None:
        """Close the channel and drop its stream."""
        channel.close()
        self._jobs.append(("close", channel, time.monotonic()))
        self.thread.wake()

    # --- model thread ---
    def _start_on_thread(self) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up()
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            self.error = exc
        else:
            self.thread.add_realtime(self)
        finally:
            self.ready.set()

    def due_at(self) -> float | None:
        due = self._jobs[0][2] if self._jobs else None
        for channel, active in self._streams.items():
            ready_at = channel.frame_ready_at(active.stream.frame_size)
            if ready_at is not None and (due is None or ready_at < due):
                due = ready_at
        return due

    def step(self) -> None:
        """Open and drop streams as asked, then one frame of every stream that has one."""
        self._apply_jobs()
        self._step_round()

    def _apply_jobs(self) -> None:
        while self._jobs:
            action, channel, _ = self._jobs.popleft()
            if action == "close":
                self._streams.pop(channel, None)
            elif not channel.closed:
                self._open(channel)
        self.open_streams = len(self._streams)

    def _open(self, channel: Channel) -> None:
        try:
            stream = self._stream_factory()
        except Exception as exc:  # noqa: BLE001 - reported to this client only
            _deliver(channel, Failed(f"cannot start a stream: {_one_line(exc)}"))
            return
        self._streams[channel] = _Active(stream)
        _deliver(channel, Opened())

    def _step_round(self) -> None:
        """One frame of every stream that has one; markers that came due are delivered after
        the steps."""
        streams = self._streams
        frames = []
        for channel, active in streams.items():
            taken = None if channel.closed else channel.take_frame(active.stream.frame_size)
            if taken is not None:
                frames.append((channel, active, *taken))
        for channel, active, frame, buffered in frames:
            try:
                step = active.stream.step(frame)
            except Exception as exc:  # noqa: BLE001 - ends this stream, not the server
                del streams[channel]
                self.open_streams = len(streams)
                _deliver(channel, Failed(f"the model failed: {_one_line(exc)}"))
                continue
            active.steps_done += 1
            _deliver(channel, Stepped(step, buffered))
        for channel, active in streams.items():
            stream = active.stream
            for marker_id in channel.due_markers(
                active.steps_done, stream.frame_size, stream.delay_steps
            ):
                _deliver(channel, MarkerReached(marker_id))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _deliver(channel: Channel, event: StreamEvent) -> None:
    try:
        channel.deliver(event)
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass
