"""A Realtime session with Moshi or PersonaPlex, full duplex, without a socket:
`DuplexRealtimeSession`, over a `moshi_mlx.chat.duplex.DuplexSession` (or anything with its
methods: `Duplex`).

How full duplex maps onto the Realtime API's events:

- Moshi hears every mic frame and speaks every frame; there are no turns to detect. The
  session shows `turn_detection: null`, and never sends `speech_started` / `speech_stopped` /
  `committed`, nor transcripts of the user (Moshi does not write them).
- Moshi's side is one long response: `response.created` (with its output item and audio part)
  when the conversation starts, then for each mic frame one `response.output_audio.delta` of
  Moshi's 80 ms and a `response.output_audio_transcript.delta` when Moshi wrote words, while
  the user's audio keeps arriving. Moshi steps only on the mic frames it gets: a client sends
  audio continuously (silence too), as a phone line does.
- `response.cancel` ends that response (`cancelled`, reason `client_cancelled`) and silences
  Moshi: the conversation goes on hearing the user, its audio and words are dropped, until
  `response.create` opens the next long response.
- PersonaPlex's persona: the session's `voice` (a PersonaPlex voice such as `NATF2`; OpenAI's
  voice names mean the server's default) and `instructions` (the role). The conversation starts
  at the first audio append (or `response.create`), so a `session.update` sent first sets the
  persona; one that changes it later restarts the conversation.
- `input_audio_buffer.commit` and `conversation.item.create` have no meaning for Moshi and
  answer an `unsupported_event` error; `input_audio_buffer.clear` drops the partial frame held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from moshi_mlx.errors import MoshiError, one_line
from moshi_mlx.realtime import events
from moshi_mlx.realtime.answer import Answer
from moshi_mlx.realtime.client_events import appended_audio, dispatch, response_metadata
from moshi_mlx.realtime.config import SessionConfig, SessionError
from moshi_mlx.realtime.dropped import DroppedAudio
from moshi_mlx.realtime.formats import FrameCutter

# OpenAI's voice names, and none: the server's default persona voice.
DEFAULT_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin",
                            "nova", "onyx", "sage", "shimmer", "verse"})  # fmt: skip


class Duplex(Protocol):
    """A full-duplex conversation (`moshi_mlx.chat.duplex.DuplexSession`)."""

    async def start(self) -> int: ...
    def push(self, frame: np.ndarray) -> None: ...
    async def next(self) -> Any: ...  # a reply (.pcm, .text), or a lag notice (.dropped)
    def close(self) -> None: ...


OpenDuplex = Callable[[str | None, str | None], Duplex]  # (voice, role) -> a new conversation


class DuplexRealtimeSession:
    """See the module docstring; the same methods as `RealtimeSession` (`start`, `handle`,
    `push_audio`, `close`); `open_duplex(voice, role)` makes a conversation (not started)."""

    def __init__(
        self,
        open_duplex: OpenDuplex,
        config: SessionConfig,
        emit: Callable[[dict[str, Any]], None],
    ):
        self.config = replace(config, turn_detection=None)
        self.id = events.new_id("sess")
        self._open_duplex = open_duplex
        self._emit = emit
        self._cutter = FrameCutter()
        self._duplex: Duplex | None = None
        self._reader: asyncio.Task | None = None
        self._response: Answer | None = None
        self._silenced = False
        self._metadata: dict[str, str] | None = None  # the requested response's, until it starts
        self._started = False
        self._transcript: list[str] = []
        self.on_frame: Callable[[np.ndarray], None] | None = None
        self.replies = 0  # Moshi's frames so far (sent or silenced)
        self.dropped = DroppedAudio(self.id)

    async def start(self) -> None:
        """Announce the session (`session.created`); the conversation starts with the audio."""
        self._emit(events.event("session.created", session=self.config.as_dict(self.id)))

    async def close(self) -> None:
        await self._stop_duplex()

    # --- the client's events ---
    async def handle(self, message: dict[str, Any]) -> None:
        """One client event; a bad one gets an `error` event, and the session goes on."""
        await dispatch(_HANDLERS, self, message, self._emit)

    def push_audio(self, pcm: np.ndarray) -> None:
        """Mic samples (float32 at 24 kHz, any count) for Moshi."""
        frames = self._cutter.add(pcm)
        if frames and self._duplex is None:
            self._open()
        for frame in frames:
            self._duplex.push(frame)

    async def _session_update(self, message: dict) -> None:
        probe = replace(self.config)
        probe.update(message.get("session"))
        probe.turn_detection = None
        persona = (probe.voice, probe.instructions) != (self.config.voice, self.config.instructions)
        self.config = probe
        if persona and self._duplex is not None:
            await self._stop_duplex()
            self._open()
        self._emit(events.event("session.updated", session=probe.as_dict(self.id)))

    async def _append(self, message: dict) -> None:
        self.push_audio(appended_audio(message, self.config.input_format))

    async def _clear(self, _message: dict) -> None:
        self._cutter.clear()
        self._emit(events.event("input_audio_buffer.cleared"))

    async def _response_create(self, message: dict) -> None:
        options = message.get("response") or {}
        if not isinstance(options, dict):
            raise SessionError("response must be an object", "response")
        metadata = response_metadata(options)
        if self._response is not None:
            raise SessionError(
                "Moshi's response is in progress; cancel it first",
                None,
                "conversation_already_has_active_response",
            )
        self._silenced = False
        self._metadata = metadata
        if self._duplex is None:
            self._open()
        elif self._started:
            self._begin_response()

    async def _response_cancel(self, _message: dict) -> None:
        if self._response is None:
            raise SessionError("no response is in progress", None, "response_cancel_not_active")
        self._silenced = True
        self._end_response("cancelled", "client_cancelled")

    async def _unsupported(self, message: dict) -> None:
        raise SessionError(
            f"{message['type']} has no meaning for Moshi, which hears the audio as it comes",
            "type",
            "unsupported_event",
        )

    # --- the conversation ---
    def _open(self) -> None:
        """A new conversation in the session's persona; it starts (and Moshi's response
        begins) on the event loop, while the frames pushed meanwhile wait for it."""
        voice = self.config.voice
        voice = None if voice in DEFAULT_VOICES else voice
        role = self.config.instructions or None
        self._duplex = self._open_duplex(voice, role)
        self._started = False
        self._reader = asyncio.create_task(self._run(self._duplex))

    async def _run(self, duplex: Duplex) -> None:
        try:
            await duplex.start()
        except MoshiError as exc:
            duplex.close()
            if duplex is self._duplex:
                self._duplex = None
                self._emit(events.error(f"Moshi cannot start: {one_line(exc)}", "session"))
            return
        self._started = True
        if not self._silenced:
            self._begin_response()
        await self._read(duplex)

    async def _stop_duplex(self) -> None:
        if self._response is not None:
            self._end_response("cancelled", "client_cancelled")
        duplex, self._duplex = self._duplex, None
        if duplex is not None:
            duplex.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None

    async def _read(self, duplex: Duplex) -> None:
        try:
            while True:
                event = await duplex.next()
                if hasattr(event, "pcm"):
                    self._reply(event.pcm, event.text)
                else:
                    self.dropped.add(event.dropped * 80)
        except MoshiError as exc:  # closed, or a step failed
            if duplex is self._duplex:
                self._emit(events.error(one_line(exc), None, "model_failed", "server_error"))
                if self._response is not None:
                    self._end_response("failed", None)
                self._duplex = None

    def _reply(self, pcm: np.ndarray, text: str) -> None:
        self.replies += 1
        response = self._response
        if response is None:
            return  # silenced
        response.frame(pcm, time.monotonic())
        if self.on_frame is not None:
            self.on_frame(pcm)
        if text:
            self._transcript.append(text)
            self._emit(
                events.event(
                    "response.output_audio_transcript.delta",
                    response_id=response.id,
                    item_id=response.item_id,
                    output_index=0,
                    content_index=0,
                    delta=text,
                )
            )

    def _begin_response(self) -> None:
        self._response = Answer(self._emit, self.config, metadata=self._metadata)
        self._metadata = None
        self._transcript = []
        item = self._response.begin()
        self._emit(events.event("conversation.item.added", item=item, previous_item_id=None))
        self._response.begin_part()

    def _end_response(self, status: str, reason: str | None) -> None:
        response, self._response = self._response, None
        response.end(status, "".join(self._transcript), reason, truncate=False)


_HANDLERS: dict[str, Callable[[DuplexRealtimeSession, dict], Awaitable[None]]] = {
    "session.update": DuplexRealtimeSession._session_update,
    "input_audio_buffer.append": DuplexRealtimeSession._append,
    "input_audio_buffer.clear": DuplexRealtimeSession._clear,
    "response.create": DuplexRealtimeSession._response_create,
    "response.cancel": DuplexRealtimeSession._response_cancel,
    "input_audio_buffer.commit": DuplexRealtimeSession._unsupported,
    "conversation.item.create": DuplexRealtimeSession._unsupported,
    "conversation.item.truncate": DuplexRealtimeSession._unsupported,
    "conversation.item.delete": DuplexRealtimeSession._unsupported,
    "conversation.item.retrieve": DuplexRealtimeSession._unsupported,
    "output_audio_buffer.clear": DuplexRealtimeSession._unsupported,
}
