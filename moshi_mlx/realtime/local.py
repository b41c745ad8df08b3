"""The Realtime API inside an app, without a socket: `LocalRealtime` runs sessions on its own
event loop thread and model thread; a `LocalSession` takes mic frames and client events from
any thread and gives back the server's events and the answer's audio, never blocking.

    realtime = LocalRealtime.load(stt="kyutai/stt-1b-en_fr", tts="kyutai/tts-1.6b-en_fr",
                                  llm="mlx-community/Qwen3-4B-4bit")
    session = realtime.session({"type": "realtime", "instructions": "Be brief."})
    session.push(mic_frame)          # float32 24 kHz, any length; from the audio callback
    frame = session.pull()           # the answer's next 80 ms, or None; from the callback
    event = session.next_event(0.1)  # a server event (dict) or None; from the app's thread
    session.send({"type": "response.create"})
    realtime.close()
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from moshi_mlx.assistant import ReplySampling, TurnRules
from moshi_mlx.errors import AudioError, TtsError, one_line
from moshi_mlx.realtime.config import (
    DEFAULT_VOICE_NAME,
    DUPLEX,
    REALTIME,
    TRANSCRIPTION,
    SessionConfig,
    SessionError,
)
from moshi_mlx.realtime.duplex import DuplexRealtimeSession, OpenDuplex
from moshi_mlx.realtime.session import VOICE_PARAM, RealtimeSession, SessionParts
from moshi_mlx.runtime.model_thread import ModelThread

# Answer frames kept for `pull` (10 s); past this the oldest go (an app that stopped pulling).
MAX_PULLED_FRAMES = 125

MakeParts = Callable[[str], Awaitable[SessionParts]]
CLONED_VOICES_ONLY = (
    "this model speaks in cloned voices only: set session.audio.output.voice to a recording "
    "(a .wav, .flac, ... file of a few seconds of speech) whose voice it clones"
)


class LocalSession:
    """One session of a `LocalRealtime`; every method is safe from any thread, and `push`,
    `send` and `pull` never block (an audio callback may call them)."""

    def __init__(self, owner: LocalRealtime):
        self._owner = owner
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._frames: deque[np.ndarray] = deque(maxlen=MAX_PULLED_FRAMES)
        self.session: RealtimeSession | None = None

    def push(self, pcm: np.ndarray) -> None:
        """Mic samples (float32, 24 kHz, any count)."""
        samples = np.array(pcm, np.float32).reshape(-1)
        self._owner.loop.call_soon_threadsafe(self.session.push_audio, samples)

    def send(self, event: dict[str, Any]) -> None:
        """A client event, as the protocol spells it (errors come back as `error` events)."""
        self._owner.loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self.session.handle(dict(event)))
        )

    def pull(self) -> np.ndarray | None:
        """The answer's next frame (float32 (1920,), 24 kHz) or None if none is waiting."""
        try:
            return self._frames.popleft()
        except IndexError:
            return None

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next server event (a dict), waiting up to `timeout` s (None: no limit)."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """End the session (blocks until its jobs have stopped)."""
        self._owner.run(self.session.close())

    def _emit(self, event: dict[str, Any]) -> None:
        self._events.put(event)

    def _frame(self, pcm: np.ndarray) -> None:
        self._frames.append(pcm)


class LocalRealtime:
    """Sessions over the models `make_parts(kind)` gives, on `thread` (started here if not
    given) and an event loop thread of its own. `from_models` and `load` build it from
    models."""

    def __init__(
        self,
        make_parts: MakeParts,
        thread: ModelThread | None = None,
        rules: TurnRules | None = None,
        sampling: ReplySampling | None = None,
    ):
        self._own_thread = thread is None
        if thread is None:
            thread = ModelThread("moshi-mlx-realtime")
            thread.start()
        self.thread = thread
        self._make_parts = make_parts
        self.duplex = False  # sessions of type "realtime" are Moshi's, full duplex
        self._rules = rules
        self._sampling = sampling
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="moshi-mlx-realtime-loop", daemon=True
        )
        self._loop_thread.start()

    @classmethod
    def from_models(
        cls,
        stt=None,
        tts=None,
        llm=None,
        moshi=None,
        thread: ModelThread | None = None,
        **options,
    ):
        """Sessions on loaded models (`SttModel`, `TtsModel`, `LlmModel`; without the TTS and
        the LLM, transcription only; a `MoshiModel` for full-duplex sessions), loaded on
        `thread`'s MLX thread. An assistant session's `voice` is a voice of the TTS (a name of
        its voice repo or a file; "alloy" is its default one) or a recording (.wav, .flac,
        ...) whose voice it clones, as `tts --voice` takes them (`request_voices`); a TTS of
        cloned voices only (tts-0.75b-en-public) takes a recording only, and a session starts
        with no voice (`CLONED_VOICES_ONLY`). A Moshi session's voice is PersonaPlex's.
        """

        def open_speech(voice):
            voices, prefix = voice
            return tts.stream(voice=voices, prefix=prefix)

        async def find_voice(name: str):
            from moshi_mlx.tts.prefix import request_voices
            from moshi_mlx.tts.voices import DEFAULT_VOICE

            voice = DEFAULT_VOICE if name == DEFAULT_VOICE_NAME else name
            try:
                return await realtime.thread.call(
                    lambda: request_voices([voice], tts.config, tts.mimi)
                )
            except (TtsError, AudioError) as exc:
                raise SessionError(one_line(exc), VOICE_PARAM, "voice_not_found") from None

        def open_duplex(voice, role):
            from moshi_mlx.chat.duplex import DuplexSession

            return DuplexSession(realtime.thread, moshi, voice=voice, role=role)

        async def make_parts(kind: str) -> SessionParts | OpenDuplex:
            if kind == DUPLEX:
                return open_duplex
            listener = await realtime.thread.call(stt.speech_to_text)
            if kind == TRANSCRIPTION or tts is None or llm is None:
                return SessionParts(listener)
            if tts.clones_only:  # no voice embeddings: a recording's voice
                no_voice = CLONED_VOICES_ONLY
                return SessionParts(listener, llm, open_speech, find_voice, None, no_voice)
            return SessionParts(listener, llm, open_speech, find_voice)

        realtime = cls(make_parts, thread, **options)
        realtime.duplex = moshi is not None and llm is None
        return realtime

    @classmethod
    def load(
        cls,
        stt: str | Path | None = None,
        tts: str | Path | None = None,
        llm: str | Path | None = None,
        moshi: str | Path | None = None,
        voice_repo: str | None = None,
    ) -> LocalRealtime:
        """Load the models (hub repo ids or folders) on a new model thread, the TTS's voices
        from `voice_repo` (a hub repo id or a folder; default Kyutai's); see `from_models`."""
        from moshi_mlx.api import load
        from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
        from moshi_mlx.llm import LlmModel

        thread = ModelThread("moshi-mlx-realtime")
        thread.start()
        models = thread.call_soon(
            lambda: (
                None if stt is None else load(stt),
                None if tts is None else load(tts, voice_repo=voice_repo or DEFAULT_VOICE_REPO),
                None if llm is None else LlmModel.load(llm),
                None if moshi is None else load(moshi),
            )
        ).result()
        realtime = cls.from_models(*models, thread=thread)
        realtime._own_thread = True
        return realtime

    def session(self, session: dict[str, Any] | None = None) -> LocalSession:
        """A new session configured by `session` (a `session.update`'s object: `{"type":
        "realtime" | "transcription", "instructions": ..., "audio": ...}`); blocks until it
        has started. Its first event is `session.created`."""
        kind = (session or {}).get("type", REALTIME)
        local = LocalSession(self)

        async def start() -> RealtimeSession | DuplexRealtimeSession:
            duplex = self.duplex and kind == REALTIME
            parts = await self._make_parts(DUPLEX if duplex else kind)
            config = SessionConfig(kind=kind)
            if not duplex:
                config.voice = parts.voice  # None: a TTS of cloned voices only
            if session:
                config.update(session)
            if duplex:
                realtime = DuplexRealtimeSession(parts, config, local._emit)
            else:
                realtime = RealtimeSession(
                    self.thread, parts, config, local._emit, self._rules, self._sampling
                )
            realtime.on_frame = local._frame
            await realtime.start()
            return realtime

        local.session = self.run(start())
        return local

    def run(self, coroutine: Awaitable[Any]) -> Any:
        """Run `coroutine` on the sessions' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        """Stop the loop (and the model thread if this object started it)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(10)
        if self._own_thread:
            self.thread.stop()
