"""One response of a Realtime session as the protocol tells it (`Answer`): its start, its
audio and transcript deltas, its end (completed, cancelled and truncated, or failed)."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from moshi_mlx.realtime import events
from moshi_mlx.realtime.config import SessionConfig
from moshi_mlx.runtime.model_thread import FRAME_SECONDS


class Answer:
    """The response in progress, spoken (`spoken`: audio with its transcript) or written (text
    only); `emit` takes the server's events. `reason` is why it would end cancelled now
    ("turn_detected" unless the client cancels it); `metadata` is its `response.create`'s."""

    def __init__(
        self,
        emit: Callable[[dict[str, Any]], None],
        config: SessionConfig,
        spoken: bool = True,
        metadata: dict[str, str] | None = None,
    ):
        self.spoken = spoken
        self.metadata = metadata
        self.text = ""  # a written answer's text so far
        self.id = events.new_id("resp")
        self.item_id = events.new_id("item")
        self.frames = 0  # sent
        self.first_sent: float | None = None  # monotonic time of the first frame sent
        self.reason = "turn_detected"
        self._emit = emit
        self._config = config
        self._words: list[str] = []

    def begin(self) -> dict[str, Any]:
        """Announce it (`response.created`, the output item, its audio part); the item."""
        self._emit(events.event("response.created", response=self._object("in_progress")))
        item = events.answer_item(self.item_id, None, "in_progress", self.spoken)
        self._emit(
            events.event(
                "response.output_item.added", response_id=self.id, output_index=0, item=item
            )
        )
        return item

    def begin_part(self) -> None:
        """Announce its content part: audio (with its transcript) or text."""
        part = {"type": "audio", "transcript": ""} if self.spoken else {"type": "text", "text": ""}
        self._emit(self._content("response.content_part.added", part=part))

    def write(self, text: str) -> None:
        """A piece of a written answer."""
        self.text += text
        self._emit(self._content("response.output_text.delta", delta=text))

    def words(self, text: str) -> None:
        """Words the speaker starts playing."""
        delta = text if not self._words else f" {text}"
        self._words.append(text)
        self._emit(self._content("response.output_audio_transcript.delta", delta=delta))

    def frame(self, pcm: np.ndarray, now: float) -> None:
        """A frame of its audio goes out."""
        if self.first_sent is None:
            self.first_sent = now
        self.frames += 1
        audio = base64.b64encode(self._config.output_format.encode(pcm)).decode("ascii")
        self._emit(self._content("response.output_audio.delta", delta=audio))

    def frames_due(self, now: float) -> int:
        """Frames the user has started hearing by `now` (real time from the first)."""
        if self.first_sent is None:
            return 0
        return int((now - self.first_sent) / FRAME_SECONDS) + 1

    def end(
        self, status: str, transcript: str, reason: str | None = None, truncate: bool = True
    ) -> dict[str, Any]:
        """Close it with `status` ("completed", "cancelled": truncated to what was heard
        unless not `truncate`, "failed") and its `transcript` (a written answer's text); the
        finished item."""
        if self.spoken:
            self._emit(self._content("response.output_audio.done"))
            done = self._content("response.output_audio_transcript.done", transcript=transcript)
            self._emit(done)
            part = {"type": "audio", "transcript": transcript}
        else:
            self._emit(self._content("response.output_text.done", text=transcript))
            part = {"type": "text", "text": transcript}
        self._emit(self._content("response.content_part.done", part=part))
        state = "completed" if status == "completed" else "incomplete"
        item = events.answer_item(self.item_id, transcript, state, self.spoken)
        self._emit(
            events.event(
                "response.output_item.done", response_id=self.id, output_index=0, item=item
            )
        )
        self._emit(events.event("conversation.item.done", item=item, previous_item_id=None))
        if status == "cancelled" and truncate and self.spoken:
            played = min(self.frames, self.frames_due(time.monotonic()))
            self._emit(
                events.event(
                    "conversation.item.truncated",
                    item_id=self.item_id,
                    content_index=0,
                    audio_end_ms=int(played * FRAME_SECONDS * 1000),
                )
            )
        self._emit(events.event("response.done", response=self._object(status, [item], reason)))
        return item

    def _content(self, kind: str, **fields: Any) -> dict[str, Any]:
        return events.event(
            kind, response_id=self.id, item_id=self.item_id, output_index=0, content_index=0,
            **fields,
        )  # fmt: skip

    def _object(self, status: str, output=(), reason: str | None = None) -> dict[str, Any]:
        config = self._config
        return events.response(
            self.id,
            status,
            list(output),
            config.voice,
            config.output_format.as_dict(),
            reason,
            ["audio"] if self.spoken else ["text"],
            self.metadata,
        )
