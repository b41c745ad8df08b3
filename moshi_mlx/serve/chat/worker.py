"""The model worker: one thread that does all MLX work (load, warm-up, prompts, every step).

MLX keeps streams and compiled kernels per thread, and a model step takes tens of
milliseconds, so the event loop never touches the model. The loop hands each client's audio
frames to a `Session` and gets results back through the session's `deliver` callback (the
loop passes one that hops onto the loop with `call_soon_threadsafe`).

Lag policy (as in the terminal app): when a session's unprocessed audio exceeds
`max_lag_frames`, the oldest frames are dropped so that Moshi answers the newest audio, and
the session is told how many were dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moshi_mlx.audio.live import frames_to_drop
from moshi_mlx.errors import MoshiError
from moshi_mlx.runtime.memory_plan import wired_memory
from moshi_mlx.runtime.sampling import SamplingConfig
from moshi_mlx.serve.chat.persona import PersonaOptions, persona_options

if TYPE_CHECKING:
    from moshi_mlx.chat.model import Conversation, MoshiModel

log = logging.getLogger("moshi_mlx.serve.chat")


@dataclass(frozen=True)
class Ready:
    """The session's conversation exists; `seed` is its random stream's seed."""

    seed: int


@dataclass(frozen=True)
class Reply:
    """One model step: Moshi's 80 ms of audio and its new text."""

    pcm: np.ndarray
    text: str


@dataclass(frozen=True)
class Lag:
    """Mic frames dropped because the model fell behind (`dropped` now, `total` so far)."""

    dropped: int
    total: int


@dataclass(frozen=True)
class Failed:
    """The model could not serve this session; the reason is for the client."""

    reason: str


WorkerEvent = Ready | Reply | Lag | Failed


class Session:
    """One client's conversation, shared between the event loop and the worker thread.

    At most one step job per session waits in the worker's queue (`_scheduled`), so open
    sessions take turns frame by frame. `voice` and `role` (PersonaPlex) are the client's
    choice, None for the server's default; set before `ModelWorker.open`.
    """

    def __init__(
        self,
        sampling: SamplingConfig,
        seed: int | None,
        deliver: Callable[[WorkerEvent], None],
        max_lag_frames: int,
    ):
        self.sampling = sampling
        self.seed = seed
        self.voice: str | None = None
        self.role: str | None = None
        self.deliver = deliver
        self.max_lag_frames = max(1, max_lag_frames)
        # Bound on queued frames even while a step stalls (a flooding client costs no memory).
        self._capacity = 4 * self.max_lag_frames + 16
        self._frames: deque[np.ndarray] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        self._unreported_drops = 0
        self.dropped_frames = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, frame: np.ndarray) -> bool:
        """Queue a mic frame (loop side); True if the worker must be woken for it."""
        with self._lock:
            if self._closed:
                return False
            if len(self._frames) >= self._capacity:
                self._frames.popleft()
                self._unreported_drops += 1
            self._frames.append(frame)
            wake = not self._scheduled
            self._scheduled = True
            return wake

    def close(self) -> None:
        """Forget queued audio; the worker frees the conversation after its current step."""
        with self._lock:
            self._closed = True
            self._frames.clear()

    def take(self) -> tuple[np.ndarray | None, int, bool]:
        """(oldest frame to step or None, frames dropped for lag, more left).

        Beyond `max_lag_frames` of backlog only the newest frame is kept (`frames_to_drop`).
        """
        with self._lock:
            lagging = frames_to_drop(len(self._frames), self.max_lag_frames)
            for _ in range(lagging):
                self._frames.popleft()
            dropped = self._unreported_drops + lagging
            self._unreported_drops = 0
            self.dropped_frames += dropped
            frame = self._frames.popleft() if self._frames else None
            self._scheduled = bool(self._frames)
            return frame, dropped, self._scheduled


class ModelWorker:
    """Loads the model on its own thread, warms it up, then runs the sessions' steps.

    `load` is called on the worker thread and returns a `moshi_mlx.chat.model.MoshiModel`; the
    warm-up compiles the step of `sampling` (the server's default: a session with other
    sampling compiles its own step when it starts). For PersonaPlex, the prompt of the
    server's `voice` and `role` (`--voice`, `--role`) is computed then too; a session with
    another voice or role waits for its own on its first connection. `ready` is set once the
    model can take sessions (or `error` says why it cannot); `persona` says then what a
    client may choose.
    """

    def __init__(
        self,
        load: Callable[[], MoshiModel],
        sampling: SamplingConfig | None = None,
        voice: str | None = None,
        role: str | None = None,
    ):
        self._load = load
        self._warmup_sampling = sampling
        self.voice, self.role = voice, role
        self.persona = PersonaOptions()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.model: MoshiModel | None = None
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self.open_conversations = 0  # written by the worker thread only
        self._thread = threading.Thread(target=self._run, name="moshi-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the current job and end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def open(self, session: Session) -> None:
        """Start the session's conversation; the session receives `Ready` or `Failed`."""
        self._jobs.put(("open", session))

    def submit(self, session: Session, frame: np.ndarray) -> None:
        """Queue one of the session's mic frames for a model step."""
        if session.push(frame):
            self._jobs.put(("step", session))

    def release(self, session: Session) -> None:
        """Close the session and free its conversation."""
        session.close()
        self._jobs.put(("close", session))

    # --- worker thread ---
    def _run(self) -> None:
        try:
            started = time.monotonic()
            self.model = self._load()
            self.model.check_prompt_choice(self.voice, self.role)
            self.load_seconds = time.monotonic() - started
            started = time.monotonic()
            self.model.warm_up(self._warmup_sampling)
            self.warmup_seconds = time.monotonic() - started
            self.persona = self._persona()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            self.error = exc
            self.ready.set()
            return
        self.ready.set()
        with wired_memory(self.model.memory):  # Apple GPUs: keep the model resident
            self._serve_jobs()

    def _persona(self) -> PersonaOptions:
        """PersonaPlex: the default prompt computed (and checked), the voices listed."""
        prompts = self.model.prompts
        if prompts is None:
            return PersonaOptions()
        prompts.state(self.voice, self.role)
        try:
            voices = prompts.voice_names()
        except MoshiError as exc:  # the default voice is a file: clients choose only roles
            log.warning("no published voices to offer: %s", exc)
            voices = []
        return persona_options(self.model, self.voice, self.role, voices)

    def _serve_jobs(self) -> None:
        conversations: dict[Session, Conversation] = {}
        while (job := self._jobs.get()) is not None:
            action, session = job
            if action == "open":
                self._open(session, conversations)
            elif action == "step":
                self._step(session, conversations)
            else:
                self._close(session, conversations)
        for session in list(conversations):
            self._close(session, conversations)

    def _close(self, session: Session, conversations: dict[Session, Conversation]) -> None:
        conversation = conversations.pop(session, None)
        if conversation is not None:
            conversation.close()
        self.open_conversations = len(conversations)

    def _open(self, session: Session, conversations: dict[Session, Conversation]) -> None:
        if session.closed:
            return
        try:
            conversation = self.model.conversation(
                sampling=session.sampling,
                seed=session.seed,
                voice=self.voice if session.voice is None else session.voice,
                role=self.role if session.role is None else session.role,
            )
        except Exception as exc:  # noqa: BLE001 - reported to this client only
            _deliver(session, Failed(f"cannot start a conversation: {exc}"))
            return
        conversations[session] = conversation
        self.open_conversations = len(conversations)
        _deliver(session, Ready(conversation.seed))
        self._jobs.put(("step", session))  # audio that came before the conversation existed

    def _step(self, session: Session, conversations: dict[Session, Conversation]) -> None:
        conversation = conversations.get(session)
        if conversation is None or session.closed:
            return
        frame, dropped, more = session.take()
        if more:
            self._jobs.put(("step", session))  # behind the other sessions' turns
        if dropped:
            _deliver(session, Lag(dropped, session.dropped_frames))
        if frame is None:
            return
        try:
            result = conversation.step(frame)
        except Exception as exc:  # noqa: BLE001 - ends this conversation, not the server
            self._close(session, conversations)
            _deliver(session, Failed(f"the model failed: {exc}"))
            return
        reply = Reply(result.pcm, result.text)
        if session.closed:  # the client left during the step: free the conversation now
            self._close(session, conversations)
            return
        _deliver(session, reply)


def _deliver(session: Session, event: WorkerEvent) -> None:
    try:
        session.deliver(event)
    except RuntimeError:  # the event loop is gone (server shutting down)
        pass
