"""Lock-free single-producer / single-consumer frame queue for audio callbacks.

An audio callback must never block, allocate large buffers or raise, so samples cross between
the PortAudio thread and the model's worker thread through preallocated numpy storage. The
producer only advances `_written` and the consumer only advances `_read`; each counter is a
Python int that one thread assigns and the other reads, which is atomic in CPython, so no lock
is needed. A frame's data is fully copied before the counter that publishes it moves.
"""

from __future__ import annotations

import numpy as np


class FrameQueue:
    """A bounded FIFO of fixed-size audio frames, each with a timestamp and the time its first
    sample was at the device (`sounded`: captured by the microphone, or due at the speaker).

    `push` (producer side) never blocks: when the queue is full the new frame is dropped and
    counted in `overflows`. `pop_into`, `pop_timed` and `drop_oldest` belong to the consumer
    side.
    """

    def __init__(self, capacity: int, frame_size: int):
        if capacity < 1 or frame_size < 1:
            raise ValueError("capacity and frame_size must be positive")
        self.capacity = capacity
        self.frame_size = frame_size
        self._frames = np.zeros((capacity, frame_size), dtype=np.float32)
        self._stamps = np.zeros((capacity, 2), dtype=np.float64)  # (stamp, sounded)
        self._written = 0  # advanced by the producer only
        self._read = 0  # advanced by the consumer only
        self.overflows = 0  # frames the producer had to drop (producer-owned)

    def __len__(self) -> int:
        return self._written - self._read

    def push(self, samples: np.ndarray, stamp: float = 0.0, sounded: float | None = None) -> bool:
        """Copy one frame in (shorter input is zero-padded, longer is cut); False if full.
        `sounded` defaults to `stamp`."""
        if self._written - self._read >= self.capacity:
            self.overflows += 1
            return False
        slot = self._written % self.capacity
        n = min(len(samples), self.frame_size)
        self._frames[slot, :n] = samples[:n]
        if n < self.frame_size:
            self._frames[slot, n:] = 0.0
        self._stamps[slot, 0] = stamp
        self._stamps[slot, 1] = stamp if sounded is None else sounded
        self._written += 1
        return True

    def pop_into(self, out: np.ndarray) -> float | None:
        """Copy the oldest frame into `out` and return its timestamp, or None if empty."""
        times = self.pop_timed(out)
        return None if times is None else times[0]

    def pop_timed(self, out: np.ndarray) -> tuple[float, float] | None:
        """Copy the oldest frame into `out` and return (timestamp, sounded), or None if empty."""
        if self._written == self._read:
            return None
        slot = self._read % self.capacity
        out[:] = self._frames[slot]
        stamp, sounded = float(self._stamps[slot, 0]), float(self._stamps[slot, 1])
        self._read += 1
        return stamp, sounded

    def drop_oldest(self, count: int) -> int:
        """Discard up to `count` of the oldest frames; returns how many were discarded."""
        count = max(0, min(count, len(self)))
        self._read += count
        return count


class StampLog:
    """Preallocated log of float values (e.g. callback times) safe to append from a callback.

    Appends beyond `capacity` are counted but not stored, so the callback never allocates.
    """

    def __init__(self, capacity: int):
        self._values = np.zeros(capacity, dtype=np.float64)
        self.count = 0

    def append(self, value: float) -> None:
        if self.count < len(self._values):
            self._values[self.count] = value
        self.count += 1

    def values(self) -> np.ndarray:
        """A copy of the stored values (at most `capacity` of them)."""
        return self._values[: min(self.count, len(self._values))].copy()
