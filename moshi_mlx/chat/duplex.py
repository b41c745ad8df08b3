"""A full-duplex Moshi conversation on a `ModelThread`, without sockets: `DuplexSession`.

Every server protocol that talks with Moshi, PersonaPlex or Hibiki (Kyutai's `/api/chat`,
OpenAI Realtime) holds one `DuplexSession` per client, on the loaded `MoshiModel` and the
process's model thread (MLX arrays belong to the thread that made them):

    session = DuplexSession(thread, model, sampling=..., seed=None, voice=None, role=None)
    seed = await session.start()   # the conversation (PersonaPlex: its prompt), on the thread
    session.push(frame)            # 1920 float32 samples at 24 kHz; any time, never blocks
    event = await session.next()   # DuplexReply(pcm, text) or DuplexLag(dropped, total)
    session.close()                # frees the conversation on the thread; idempotent

`push` may come before `start`: the frames wait for the conversation. Each session is a
real-time job of the thread (`RealTimeClock`), due when a frame is waiting, so open sessions
take turns frame by frame, oldest frame first. Lag policy (as the terminal app's): once more
than `max_lag_frames` frames wait, the oldest are dropped so that Moshi answers the newest
audio, and a `DuplexLag` says how many. `start` raises `MoshiError` when the conversation
cannot start (a bad persona, the thread stopped); `next` raises `DuplexFailed` when a step
fails, and `DuplexClosed` once the session is closed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moshi_mlx.audio.live import frames_to_drop
from moshi_mlx.errors import AudioError, MoshiError, one_line
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import ModelThread, RealTimeClock

if TYPE_CHECKING:
    from moshi_mlx.chat.generate import ChatSampling
    from moshi_mlx.chat.model import Conversation, MoshiModel

DEFAULT_MAX_LAG_FRAMES = 3  # 0.24 s: the terminal app's default --max-lag


@dataclass(frozen=True)
class DuplexReply:
    """One model step: Moshi's 80 ms of audio, (1920,) float32 at 24 kHz, and its new text."""

    pcm: np.ndarray
    text: str


@dataclass(frozen=True)
class DuplexLag:
    """Frames of the user's audio dropped because the model fell behind (`dropped` now,
    `total` in the session so far)."""

    dropped: int
    total: int


class DuplexFailed(MoshiError):
    """A step of the conversation failed; the session is over (the message is one line)."""


class DuplexClosed(MoshiError):
    """The session was closed."""


class DuplexSession(RealTimeClock):
    """One client's full-duplex conversation with `model`, stepped on `thread` (see the module
    docstring). `sampling` (the text's and the audio's `Sampling`; None: the model's
    defaults), `seed`, `voice`, `role` and `cfg_coef` are those of
    `MoshiModel.conversation`; `max_lag_frames` bounds the audio waiting for the model."""

    def __init__(
        self,
        thread: ModelThread,
        model: MoshiModel,
        sampling: ChatSampling | None = None,
        seed: int | None = None,
        voice: str | Path | None = None,
        role: str | None = None,
        cfg_coef: float | None = None,
        max_lag_frames: int = DEFAULT_MAX_LAG_FRAMES,
    ):
        super().__init__()
        self.thread = thread
        self.model = model
        self.sampling = sampling
        self.seed = seed
        self.voice, self.role, self.cfg_coef = voice, role, cfg_coef
        self.max_lag_frames = max(1, max_lag_frames)
        # Bound on waiting frames even while a step stalls (a flooding client costs no memory).
        self._capacity = 4 * self.max_lag_frames + 16
        self._lock = threading.Lock()
        self._frames: deque[tuple[np.ndarray, float]] = deque()  # (frame, when pushed)
        self._overflow = 0  # frames dropped by the capacity bound, not reported yet
        self._conversation: Conversation | None = None  # the model thread's only
        self._stepping = False  # a conversation exists and the thread steps it
        self._closed = False
        self._events: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped_frames = 0

    # --- the caller's side (an event loop) ---
    async def start(self) -> int:
        """Start the conversation on the model thread (PersonaPlex computes or loads its
        prompt) and step the frames pushed so far; returns its seed. `MoshiError` (its one
        line for the client) when it cannot start."""
        self._loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        try:
            return await self.thread.call(self._open_on_thread)
        except MoshiError:
            raise
        except Exception as exc:  # noqa: BLE001 - a library failure, told as one line
            raise MoshiError(one_line(exc)) from None

    def push(self, frame: np.ndarray) -> None:
        """Queue one frame of the user's audio, (1920,) float32 at 24 kHz (any thread)."""
        if np.shape(frame) != (FRAME_SIZE,):
            raise AudioError(f"push takes {FRAME_SIZE} samples, got shape {np.shape(frame)}")
        with self._lock:
            if self._closed:
                return
            if len(self._frames) >= self._capacity:
                self._frames.popleft()
                self._overflow += 1
            self._frames.append((frame, time.monotonic()))
            wake = self._stepping and len(self._frames) == 1
        if wake:
            self.thread.wake()

    async def next(self) -> DuplexReply | DuplexLag:
        """The next event of the conversation, in order; `DuplexFailed` when a step failed,
        `DuplexClosed` once closed."""
        if self._events is None:
            raise MoshiError("start the session before reading its events")
        event = await self._events.get()
        if isinstance(event, BaseException):
            self._events.put_nowait(event)  # every later call raises it too
            raise event
        return event

    def close(self) -> None:
        """End the session (any thread): waiting audio is dropped, the conversation is freed
        on the model thread after the step running now; `next` raises `DuplexClosed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._frames.clear()
        self.thread.remove_realtime(self)
        self.thread.call_soon(self._close_on_thread)  # fails harmlessly once the thread stopped
        self._emit(DuplexClosed("the session is closed"))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def freed(self) -> bool:
        """Closed, and the model thread holds no state of the conversation any more."""
        return self._closed and self._conversation is None

    # --- the model thread ---
    def _open_on_thread(self) -> int:
        text_sampling, audio_sampling = self.sampling or (None, None)
        conversation = self.model.conversation(
            text_sampling=text_sampling,
            audio_sampling=audio_sampling,
            seed=self.seed,
            voice=self.voice,
            role=self.role,
            cfg_coef=self.cfg_coef,
        )
        with self._lock:
            if self._closed:
                conversation.close()
                raise DuplexClosed("the session is closed")
            self._conversation = conversation
            self._stepping = True
        self.thread.add_realtime(self)
        return conversation.seed

    def _close_on_thread(self) -> None:
        if self._conversation is not None:
            self._conversation.close()
            self._conversation = None

    def due_at(self) -> float | None:
        with self._lock:
            return self._frames[0][1] if self._stepping and self._frames else None

    def step(self) -> None:
        with self._lock:
            if self._closed or self._conversation is None:
                return
            lagging = frames_to_drop(len(self._frames), self.max_lag_frames)
            for _ in range(lagging):
                self._frames.popleft()
            dropped, self._overflow = self._overflow + lagging, 0
            self.dropped_frames += dropped
            frame = self._frames.popleft()[0] if self._frames else None
        if dropped:
            self._emit(DuplexLag(dropped, self.dropped_frames))
        if frame is None:
            return
        try:
            result = self._conversation.step(frame)
        except Exception as exc:  # noqa: BLE001 - ends this conversation, not the thread
            self.thread.remove_realtime(self)
            self._close_on_thread()
            self._emit(DuplexFailed(f"the model failed: {one_line(exc)}"))
            return
        if self._closed:  # closed during the step: free the conversation now
            self._close_on_thread()
            return
        self._emit(DuplexReply(result.pcm, result.text))

    def failed(self, exc: BaseException) -> None:
        self._emit(DuplexFailed(f"the model failed: {one_line(exc)}"))

    def _emit(self, event: object) -> None:
        if self._loop is None or self._events is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the caller's loop is gone (shutting down)
            pass
