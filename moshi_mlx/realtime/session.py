"""One Realtime session, without a socket: `RealtimeSession` takes the client's events (dicts,
as the GA protocol spells them) and mic audio, and hands the server's events to `emit`.

    session = RealtimeSession(thread, parts, SessionConfig(), emit=outbox.append)
    await session.start()               # session.created
    await session.handle({"type": "input_audio_buffer.append", "audio": "..."})
    await session.close()

The conversation is the assistant's engine (`moshi_mlx.assistant.Assistant`): its STT hears
the user, its turn-taking ends turns with the pause head, its LLM answers and its TTS speaks.
The answer's audio goes out at real time from its first frame, `LEAD_FRAMES` ahead, so that
what was sent is, within that lead, what the user heard when a barge-in cuts it. A
transcription session is the same engine without the LLM and the TTS. Everything here runs
on the event loop; the models run on the model thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from moshi_mlx.assistant import Assistant, History, ReplySampling, TurnRules
from moshi_mlx.assistant.history import Turn
from moshi_mlx.assistant.jobs import Listener, SpeechStream
from moshi_mlx.assistant.pipeline import (
    AnswerText,
    AssistantWords,
    Event,
    Notice,
    ReplyModel,
    UserWords,
)
from moshi_mlx.assistant.turns import (
    AnswerEnded,
    FlushStt,
    StartReply,
    State,
    StopReply,
    UserSaid,
    UserStarted,
)
from moshi_mlx.realtime import events
from moshi_mlx.realtime.answer import Answer
from moshi_mlx.realtime.client_events import appended_audio, dispatch, response_metadata
from moshi_mlx.realtime.config import (
    DEFAULT_VOICE_NAME,
    REALTIME,
    SessionConfig,
    SessionError,
    output_modalities,
)
from moshi_mlx.realtime.dropped import DroppedAudio
from moshi_mlx.realtime.formats import FrameCutter
from moshi_mlx.realtime.items import ItemLog, message_text
from moshi_mlx.runtime.model_thread import FRAME_SECONDS, ModelThread

# Frames of an answer sent ahead of real time (the client's playback buffer).
LEAD_FRAMES = 3
# Seconds of mic audio the STT may fall behind (a client sending faster than real time).
MAX_INPUT_BACKLOG_SECONDS = 15
VOICE_PARAM = "session.audio.output.voice"


@dataclass(frozen=True)
class SessionParts:
    """What a session runs on: its own STT stream; for the assistant kind the LLM,
    `open_speech(voice)` (on the model thread: a TTS stream in a voice `find_voice(name)`
    gave), `find_voice` (a voice name to what `open_speech` takes; SessionError if the
    server has no such voice), the `voice` a session starts in (None: none, for a TTS with
    no default voice; answers are spoken once the client names one) and `no_voice`, the
    message that refuses a spoken answer until then."""

    stt: Listener
    llm: ReplyModel | None = None
    open_speech: Callable[[Any], SpeechStream] | None = None
    find_voice: Callable[[str], Awaitable[Any]] | None = None
    voice: str | None = DEFAULT_VOICE_NAME
    no_voice: str = "the session has no voice: set session.audio.output.voice"


class RealtimeSession:
    """See the module docstring. `rules` and `sampling` are the server's; the session's
    turn detection and `max_output_tokens` adjust them."""

    def __init__(
        self,
        thread: ModelThread,
        parts: SessionParts,
        config: SessionConfig,
        emit: Callable[[dict[str, Any]], None],
        rules: TurnRules | None = None,
        sampling: ReplySampling | None = None,
    ):
        self.thread = thread
        self.parts = parts
        self.config = config
        self.id = events.new_id("sess")
        self._emit = emit
        self._base_rules = rules or TurnRules()
        self._base_sampling = sampling or ReplySampling()
        self._voice: Any = None
        self._items = ItemLog()
        self._cutter = FrameCutter()
        self._heard_ms = 0  # mic audio taken so far
        self._uncommitted_ms = 0  # mic audio since the last commit
        self._dropped = 0  # mic frames the STT fell behind on, counted
        self.dropped = DroppedAudio(self.id)
        self._committing = False
        self._user: str | None = None  # the user's spoken item in progress
        self._user_words: list[tuple[str, float]] = []
        self._user_end = 0.0
        self._response: Answer | None = None
        # response.create's metadata, and whether one is starting the answer now.
        self._metadata: dict[str, str] | None = None
        self._creating = False
        self._pump_timer: asyncio.TimerHandle | None = None
        self.assistant: Assistant | None = None
        # Each frame of the answer as it goes out (float32 24 kHz), for an in-process app.
        self.on_frame: Callable[[np.ndarray], None] | None = None

    @property
    def speaks(self) -> bool:
        return self.config.kind == REALTIME and self.parts.llm is not None

    # --- life ---
    async def start(self) -> None:
        """Start the conversation and announce the session (`session.created`)."""
        if self.speaks and self.parts.find_voice is not None and self.config.voice is not None:
            self._voice = await self.parts.find_voice(self.config.voice)
        max_backlog = int(MAX_INPUT_BACKLOG_SECONDS / FRAME_SECONDS)
        self.assistant = Assistant(
            self.thread,
            self.parts.stt,
            self.parts.llm if self.speaks else None,
            self._open_speech if self.speaks else None,
            History(self.config.instructions),
            rules=self.config.rules(self._base_rules),
            sampling=self._sampling(),
            on_event=self._on_event,
            on_audio=self._pump,
            max_backlog=max_backlog,
        )
        self.assistant.speak_answers = self._voiced(self.config.speaks)
        await self.assistant.start()
        self._emit(events.event("session.created", session=self.config.as_dict(self.id)))

    async def close(self) -> None:
        """Stop the conversation; events after this are dropped."""
        if self._pump_timer is not None:
            self._pump_timer.cancel()
        if self.assistant is not None:
            await self.assistant.close()

    def _open_speech(self) -> SpeechStream:
        if self.config.voice is None:  # a stream opened ahead: no answer speaks without a voice
            raise SessionError(self.parts.no_voice, VOICE_PARAM, "voice_not_found")
        return self.parts.open_speech(self._voice)

    def _voiced(self, speaks: bool) -> bool:
        """Whether an answer that `speaks` by the session's settings is spoken: in a voice."""
        return speaks and self.config.voice is not None

    def _sampling(self) -> ReplySampling:
        tokens = self.config.max_output_tokens or self._base_sampling.max_tokens
        return replace(self._base_sampling, max_tokens=tokens)

    # --- the client's events ---
    async def handle(self, message: dict[str, Any]) -> None:
        """One client event; a bad one gets an `error` event, and the session goes on."""
        await dispatch(_HANDLERS, self, message, self._emit)

    def push_audio(self, pcm: np.ndarray) -> None:
        """Mic samples (float32 at 24 kHz, any count) for the STT."""
        for frame in self._cutter.add(pcm):
            self._hear(frame)

    def _hear(self, frame: np.ndarray) -> None:
        self.assistant.hear(frame)
        self._heard_ms += int(FRAME_SECONDS * 1000)
        self._uncommitted_ms += int(FRAME_SECONDS * 1000)
        dropped = self.assistant.listen_job.dropped_frames
        if dropped > self._dropped:
            self.dropped.add(int((dropped - self._dropped) * FRAME_SECONDS * 1000))
            self._dropped = dropped

    async def _session_update(self, message: dict) -> None:
        probe = replace(self.config)
        probe.update(message.get("session"))
        renew = self.speaks and probe.voice != self.config.voice
        if renew and self.parts.find_voice is not None:
            if self._response is not None:
                raise SessionError("the voice cannot change during a response", "voice")
            self._voice = await self.parts.find_voice(probe.voice)
        self.config = probe
        if renew:  # the stream opened ahead is in the old voice (or none)
            self.assistant.renew_speech()
        self.assistant.turns.rules = probe.rules(self._base_rules)
        self.assistant.turns.history.system = probe.instructions
        self.assistant.sampling = self._sampling()
        self.assistant.speak_answers = self._voiced(probe.speaks)
        self._emit(events.event("session.updated", session=probe.as_dict(self.id)))

    async def _append(self, message: dict) -> None:
        self.push_audio(appended_audio(message, self.config.input_format))

    async def _commit(self, _message: dict) -> None:
        rest = self._cutter.rest()
        if rest is not None:
            self._hear(rest)
        if self._uncommitted_ms == 0:
            raise SessionError(
                "the input audio buffer is empty", None, "input_audio_buffer_commit_empty"
            )
        if self.assistant.turns.state not in (State.LISTENING, State.USER_SPEAKING):
            raise SessionError(
                "the server is ending the user's turn or answering; commit after it",
                None,
                "conversation_already_has_active_response",
            )
        self._committing = True
        self._user = self._user or events.new_id("item")
        self.assistant.commit()

    async def _clear(self, _message: dict) -> None:
        self._cutter.clear()
        self.assistant.clear_input()
        self._uncommitted_ms = 0
        self._user, self._user_words = None, []
        self._emit(events.event("input_audio_buffer.cleared"))

    async def _item_create(self, message: dict) -> None:
        item = message.get("item")
        role, text = message_text(item)
        history = self.assistant.turns.history
        if role == "system":
            history.system = f"{history.system}\n{text}".strip()
        else:
            history.add(role, text)
        given = item.get("id")
        item_id = given if isinstance(given, str) and 0 < len(given) <= 64 else None
        self._add_item(events.text_item(item_id or events.new_id("item"), role, text))

    async def _item_truncate(self, message: dict) -> None:
        item_id, end_ms = message.get("item_id"), message.get("audio_end_ms")
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
            raise SessionError("audio_end_ms must be a whole number of ms", "audio_end_ms")
        if self._response is not None and item_id == self._response.item_id:
            self._response.reason = "client_cancelled"
            self.assistant.cancel()
        if not self._items.truncate(item_id, end_ms / 1000):
            raise SessionError("no answer of this session has that item_id", "item_id")
        self._emit(
            events.event(
                "conversation.item.truncated",
                item_id=item_id,
                content_index=0,
                audio_end_ms=end_ms,
            )
        )

    async def _response_create(self, message: dict) -> None:
        options = message.get("response") or {}
        if not isinstance(options, dict):
            raise SessionError("response must be an object", "response")
        instructions = options.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise SessionError("response.instructions must be a string", "response.instructions")
        metadata = response_metadata(options)
        if not self.speaks:
            raise SessionError("a transcription session does not answer", "type")
        if self._response is not None:
            raise SessionError(
                "a response is in progress; cancel it first",
                None,
                "conversation_already_has_active_response",
            )
        modalities = options.get("output_modalities")
        speaks = self.config.speaks
        if modalities is not None:
            speaks = "audio" in output_modalities(modalities, "response.output_modalities")
        if speaks and self.config.voice is None:
            raise SessionError(self.parts.no_voice, VOICE_PARAM, "voice_not_found")
        self.assistant.speak_answers = speaks
        self._metadata, self._creating = metadata, True
        try:
            started = self.assistant.respond(instructions)
        finally:
            self.assistant.speak_answers = self._voiced(self.config.speaks)
            self._metadata, self._creating = None, False
        if not started:
            raise SessionError(
                "the user's turn is being transcribed; the answer follows it",
                None,
                "conversation_already_has_active_response",
            )

    async def _response_cancel(self, _message: dict) -> None:
        if self._response is None:
            raise SessionError("no response is in progress", None, "response_cancel_not_active")
        self._response.reason = "client_cancelled"
        self.assistant.cancel()

    async def _unsupported(self, message: dict) -> None:
        raise SessionError(
            f"{message['type']} is not supported by this server", "type", "unsupported_event"
        )

    # --- the engine's events ---
    def _on_event(self, event: Event) -> None:
        if isinstance(event, UserStarted):
            self._user = self._user or events.new_id("item")
            if self.config.turn_detection is not None:
                start = int(event.time * 1000)
                self._emit(
                    events.event(
                        "input_audio_buffer.speech_started",
                        audio_start_ms=start,
                        item_id=self._user,
                    )
                )
        elif isinstance(event, UserWords):
            self._user_heard(event)
        elif isinstance(event, FlushStt):
            self._user_end = self._heard_ms / 1000
            if not self._committing:
                self._user = self._user or events.new_id("item")
                stopped = events.event(
                    "input_audio_buffer.speech_stopped",
                    audio_end_ms=self._heard_ms,
                    item_id=self._user,
                )
                self._emit(stopped)
        elif isinstance(event, UserSaid):
            self._user_said(event.text)
        elif isinstance(event, StartReply):
            self._start_response()
        elif isinstance(event, AssistantWords) and self._response is not None:
            self._response.words(event.text)
        elif isinstance(event, AnswerText) and self._response is not None:
            self._response.write(event.text)
        elif isinstance(event, StopReply) and self._response is not None:
            heard = event.heard if self._response.spoken else self._response.text
            self._finish_response("cancelled", heard, self._response.reason)
        elif isinstance(event, AnswerEnded) and not event.cut_off and self._response is not None:
            text = event.text if self._response.spoken else self._response.text
            self._finish_response("completed", text)
        elif isinstance(event, Notice):
            self._emit(events.error(event.text, None, "model_failed", "server_error"))
            if self._response is not None and self.assistant.turns.state is State.LISTENING:
                self._finish_response("failed", "")

    def _user_heard(self, words: UserWords) -> None:
        self._user = self._user or events.new_id("item")
        delta = words.text if not self._user_words else f" {words.text}"
        pieces = words.text.split()
        starts = list(words.starts) + [words.starts[-1] if words.starts else 0.0] * len(pieces)
        self._user_words += list(zip(pieces, starts, strict=False))
        self._emit(
            events.event(
                "conversation.item.input_audio_transcription.delta",
                item_id=self._user,
                content_index=0,
                delta=delta,
            )
        )

    def _user_said(self, text: str) -> None:
        item_id = self._user or events.new_id("item")
        self._user, self._committing = None, False
        words, self._user_words = self._user_words, []
        seconds = self._uncommitted_ms / 1000
        self._uncommitted_ms = 0
        previous = self._items.last
        self._emit(
            events.event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        )
        self._add_item(events.user_audio_item(item_id, None, False), done=False)
        if self.config.word_timings:
            ends = [start for _, start in words[1:]] + [self._user_end]
            for (word, start), end in zip(words, ends, strict=True):
                self._emit(
                    events.event(
                        "conversation.item.input_audio_transcription.segment",
                        id=events.new_id("seg"),
                        item_id=item_id,
                        content_index=0,
                        text=word,
                        start=start,
                        end=max(start, end),
                        speaker="user",
                    )
                )
        completed = events.event(
            "conversation.item.input_audio_transcription.completed",
            item_id=item_id,
            content_index=0,
            transcript=text,
            usage={"type": "duration", "seconds": seconds},
        )
        self._emit(completed)
        done = events.user_audio_item(item_id, text, True)
        self._items.replace(item_id, done)
        self._emit(events.event("conversation.item.done", item=done, previous_item_id=previous))

    def _add_item(self, item: dict, done: bool = True) -> None:
        previous = self._items.last
        self._items.add(item)
        self._emit(events.event("conversation.item.added", item=item, previous_item_id=previous))
        if done:
            self._emit(events.event("conversation.item.done", item=item, previous_item_id=previous))

    # --- the answer ---
    def _start_response(self) -> None:
        spoken = self.assistant.answer_speaks
        if not (spoken or self._creating) and self.config.speaks:  # a turn's answer, no voice
            message = f"{self.parts.no_voice} (this answer is written only)"
            self._emit(events.error(message, VOICE_PARAM, "voice_not_found"))
        self._response = Answer(self._emit, self.config, spoken, self._metadata)
        item = self._response.begin()
        self._add_item(item, done=False)
        self._response.begin_part()

    def _finish_response(self, status: str, transcript: str, reason: str | None = None) -> None:
        if self._pump_timer is not None:
            self._pump_timer.cancel()
            self._pump_timer = None
        response, self._response = self._response, None
        history = self.assistant.turns.history
        turn = history.turns[-1] if history.turns else None
        heard = turn if turn is not None and turn.role == "assistant" else Turn("assistant", "")
        item = response.end(status, transcript, reason)
        self._items.answer(item, list(self.assistant.speak_job.words), heard)

    def _pump(self) -> None:
        """Send the answer's frames that are ready, at most `LEAD_FRAMES` ahead of real time
        from its first; come back when the next one is due."""
        if self._pump_timer is not None:
            self._pump_timer.cancel()
            self._pump_timer = None
        while True:
            now = time.monotonic()
            response = self._response
            if response is not None and response.frames - response.frames_due(now) >= LEAD_FRAMES:
                due = response.first_sent + (response.frames - LEAD_FRAMES) * FRAME_SECONDS
                loop = asyncio.get_running_loop()
                self._pump_timer = loop.call_later(max(0.0, due - now), self._pump)
                return
            frame = self.assistant.speak()
            if frame is None:
                return
            if response is not None:  # else a frame of an answer that has ended
                response.frame(frame, now)
                if self.on_frame is not None:
                    self.on_frame(frame)


_HANDLERS: dict[str, Callable[[RealtimeSession, dict], Awaitable[None]]] = {
    "session.update": RealtimeSession._session_update,
    "input_audio_buffer.append": RealtimeSession._append,
    "input_audio_buffer.commit": RealtimeSession._commit,
    "input_audio_buffer.clear": RealtimeSession._clear,
    "conversation.item.create": RealtimeSession._item_create,
    "conversation.item.truncate": RealtimeSession._item_truncate,
    "response.create": RealtimeSession._response_create,
    "response.cancel": RealtimeSession._response_cancel,
    "conversation.item.delete": RealtimeSession._unsupported,
    "conversation.item.retrieve": RealtimeSession._unsupported,
    "output_audio_buffer.clear": RealtimeSession._unsupported,
}
