"""The chat model of a server: loaded and warmed up on the server's `ModelThread`, with the
settings every `/api/chat` conversation starts from (`ChatSettings`).

The server listens while the model loads (its pages are served, its websockets pinged);
`ready` is set once conversations can start, or `error` says why they cannot. Each
conversation is a `moshi_mlx.chat.duplex.DuplexSession` on the same thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moshi_mlx.chat.duplex import DEFAULT_MAX_LAG_FRAMES, DuplexSession
from moshi_mlx.chat.generate import AUDIO_SAMPLING, TEXT_SAMPLING, ChatSampling
from moshi_mlx.errors import MoshiError
from moshi_mlx.runtime.memory_plan import wired_memory
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.chat.persona import PersonaOptions, persona_options

if TYPE_CHECKING:
    from moshi_mlx.chat.model import MoshiModel

PAGE_DIR = Path(__file__).parent / "static"

log = logging.getLogger("moshi_mlx.serve.chat")


@dataclass(frozen=True)
class ChatSettings:
    """What the server's flags decide for every conversation."""

    sampling: ChatSampling = (TEXT_SAMPLING, AUDIO_SAMPLING)  # the text's, then the audio's
    seed: int | None = None
    max_lag_frames: int = DEFAULT_MAX_LAG_FRAMES
    max_conversations: int = 1
    static_dir: Path = PAGE_DIR  # `/` and the page's files (Kyutai's client with --static)
    voice: str | None = None  # PersonaPlex: the default persona (--voice, --role)
    role: str | None = None
    cfg_coef: float | None = None  # Hibiki's guidance (None: the model's config)


class ChatService:
    """Loads the chat model with `load` on `thread` (`start`), keeps it wired on Apple GPUs,
    warms up the step of `settings.sampling` and computes PersonaPlex's default prompt; then
    opens one `DuplexSession` per conversation (`session`)."""

    def __init__(
        self,
        thread: ModelThread,
        load: Callable[[], MoshiModel],
        settings: ChatSettings | None = None,
    ):
        self.thread = thread
        self.settings = settings or ChatSettings()
        self._load = load
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.model: MoshiModel | None = None
        self.persona = PersonaOptions()
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self._wired = contextlib.ExitStack()  # the model thread's only
        self._sessions: set[DuplexSession] = set()

    def start(self) -> concurrent.futures.Future:
        """Load and warm up on the model thread; the future of that work (`ready` is set
        when it ends either way)."""
        return self.thread.call_soon(self._start_on_thread)

    def stop(self) -> None:
        """Release the wired memory (on the model thread, before it stops)."""
        self.thread.call_soon(self._wired.close)

    def session(self, sampling: ChatSampling, seed: int | None, voice, role) -> DuplexSession:
        """A conversation of the loaded model (`ready` and no `error`); `voice` and `role`
        None take the server's."""
        settings = self.settings
        session = DuplexSession(
            self.thread,
            self.model,
            sampling,
            seed,
            settings.voice if voice is None else voice,
            settings.role if role is None else role,
            settings.cfg_coef,
            settings.max_lag_frames,
        )
        for freed in [s for s in self._sessions if s.freed]:
            self._sessions.discard(freed)
        self._sessions.add(session)
        return session

    @property
    def open_conversations(self) -> int:
        """Conversations whose state the model thread still holds."""
        return sum(not session.freed for session in list(self._sessions))

    # --- model thread ---
    def _start_on_thread(self) -> None:
        settings = self.settings
        try:
            started = time.monotonic()
            self.model = self._load()
            self.model.check_prompt_choice(settings.voice, settings.role)
            self._wired.enter_context(wired_memory(self.model.memory))
            self.load_seconds = time.monotonic() - started
            started = time.monotonic()
            self.model.warm_up(*settings.sampling, settings.cfg_coef)
            self.warmup_seconds = time.monotonic() - started
            self.persona = self._persona()
        except BaseException as exc:  # told to the server and its clients
            self.error = exc
            raise
        finally:
            self.ready.set()

    def _persona(self) -> PersonaOptions:
        """PersonaPlex: the default prompt computed (and checked), the voices listed."""
        prompts = self.model.prompts
        if prompts is None:
            return PersonaOptions()
        prompts.state(self.settings.voice, self.settings.role)
        try:
            voices = prompts.voice_names()
        except MoshiError as exc:  # the default voice is a file: clients choose only roles
            log.warning("no published voices to offer: %s", exc)
            voices = []
        return persona_options(self.model, self.settings.voice, self.settings.role, voices)
