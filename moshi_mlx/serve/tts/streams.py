"""The server's text-to-speech streams, rows of batches (`TtsBatch`) stepped by one real-time
job of the `ModelThread`: `TtsStreams`.

Streams join and leave at any time; each is a row of the batch of its sampling (temperature
and top-k are per batch in `TtsBatch`; guidance `cfg_coef` is per row) and of its voice's
length (a batch's voices have one number of frames; for a model of cloned voices guided by
null rows, tts-0.75b-en-public: of its `cfg_coef`, one per batch): one batch, hence one compiled step per
80 ms frame, for every stream of a kind. A batch with no stream is dropped; the next stream
of its kind starts a new one, seeded by its `seed`.

Pacing (per batch): each row is due at once until its first audio, then while less than
`ahead_seconds` of its audio are out beyond real time; a row that waits for words its client
has not sent is not due. The batch steps when its earliest row is due, so a waiting row
never holds the others: it is stepped with them and reads padding (the model pauses), as in
Kyutai's batched server; a row that is ahead gets further ahead while another starts.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Hashable

import numpy as np

from moshi_mlx.errors import TtsError, one_line
from moshi_mlx.runtime.model_thread import RealTimeClock
from moshi_mlx.serve.tts.session import AHEAD_SECONDS, TtsSession
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest
from moshi_mlx.tts.voices import VoiceEmbedding


class _Group:
    """One batch and the sessions in its rows."""

    def __init__(self, batch: TtsBatch):
        self.batch = batch
        self.sessions: dict[int, TtsSession] = {}

    def due_at(self, ahead: float) -> float | None:
        due = None
        for row, session in self.sessions.items():
            at = session.due_at(self.batch.schedule(row).waiting, ahead)
            if at is not None and (due is None or at < due):
                due = at
        return due


class TtsStreams(RealTimeClock):
    """Every TTS stream of a server, each a row of a batch of `rows`; see the module
    docstring. `start` and `stop` are called on the event loop (then `ModelThread.wake`)."""

    def __init__(self, model: TtsModel, rows: int, ahead_seconds: float = AHEAD_SECONDS):
        super().__init__()
        self.model = model
        self.rows = rows
        self._ahead = ahead_seconds
        # (when asked, joining, session): appended on the loop, taken on the thread
        self._changes: deque[tuple[float, bool, TtsSession]] = deque()
        self._groups: dict[Hashable, _Group] = {}  # model thread only
        self.batch_steps = 0  # compiled steps taken (each one frame of every row of a batch)

    # --- event loop ---
    def start(self, session: TtsSession) -> None:
        """The session's stream joins a batch at the next step."""
        self._changes.append((time.monotonic(), True, session))

    def stop(self, session: TtsSession) -> None:
        """The session's stream leaves (the client went, or its speech ended)."""
        self._changes.append((time.monotonic(), False, session))

    # --- model thread ---
    @property
    def open_streams(self) -> int:
        return sum(len(group.sessions) for group in self._groups.values())

    def due_at(self) -> float | None:
        due = self._changes[0][0] if self._changes else None
        for group in self._groups.values():
            for session in group.sessions.values():
                if session.has_text and (due is None or session.text_at < due):
                    due = session.text_at
            at = group.due_at(self._ahead)
            if at is not None and (due is None or at < due):
                due = at
        return due

    def step(self) -> None:
        """Joins and leaves, the text that came, then one step of every batch that is due."""
        while self._changes:
            _, joining, session = self._changes.popleft()
            if joining:
                self._join(session)
            else:
                self._leave(session)
        now = time.monotonic()
        for key, group in list(self._groups.items()):
            for row, session in list(group.sessions.items()):
                try:
                    self._feed(group.batch, row, session)
                except Exception as exc:  # noqa: BLE001 - ends this stream, not the others
                    session.fail(f"cannot speak this text: {one_line(exc)}")
                    self._leave(session)
            if key not in self._groups:
                continue
            due = group.due_at(self._ahead)
            if due is not None and due <= now:
                self._step(key, group)

    def _feed(self, batch: TtsBatch, row: int, session: TtsSession) -> None:
        for text in session.take_text():
            if session.closed:
                continue
            if text is None:
                batch.close(row)
                session.closed = True
            else:
                batch.push(row, text)

    def _join(self, session: TtsSession) -> None:
        if session.done:
            return
        try:
            self._add(session)
        except TtsError as exc:  # the client's voice or options, in API terms
            session.fail(one_line(exc))
        except Exception as exc:  # noqa: BLE001 - reported to this client only
            session.fail(f"the model failed: {one_line(exc)}")

    def _add(self, session: TtsSession) -> None:
        options = session.options
        voice = options.voice
        if isinstance(voice, np.ndarray):  # the client's own, kept by its content
            voice = VoiceEmbedding(voice)
        if self.model.clones_only:  # its voice is its prefix; one guidance
            if voice is not None:
                raise TtsError(
                    "this model speaks in cloned voices only: it takes no Voice embedding",
                    parameter="voice",
                )
            key, voices = (options.sampling, options.cfg_coef), ()
        else:
            key, voices = (options.sampling, self.model.voice(voice).shape[0]), (voice,)
        group = self._groups.get(key)
        if group is None:
            seed = options.seed if options.seed is not None else _random_seed()
            group = _Group(TtsBatch(self.model, self.rows, *options.sampling, seed))
        row = group.batch.add(TtsRequest("", voices, options.cfg_coef, options.prefix))
        self._groups[key] = group
        group.sessions[row] = session
        session.row = row

    def _leave(self, session: TtsSession) -> None:
        session.done = True
        for key, group in list(self._groups.items()):
            if group.sessions.get(session.row) is session:
                del group.sessions[session.row]
                group.batch.remove(session.row)
                if not group.sessions:
                    del self._groups[key]

    def _step(self, key: Hashable, group: _Group) -> None:
        try:
            outputs = group.batch.step()
        except Exception as exc:  # noqa: BLE001 - ends this batch's streams, not the server
            del self._groups[key]
            for session in group.sessions.values():
                session.fail(f"the model failed: {one_line(exc)}")
            return
        self.batch_steps += 1
        for output in outputs:
            session = group.sessions[output.row]
            if output.pcm is not None:
                session.audio(output.pcm)
            words = group.batch.words(output.row)
            session.words(words)
            if output.finished:
                session.finish(words)
                del group.sessions[output.row]
                group.batch.remove(output.row)
        if not group.sessions:
            del self._groups[key]


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")
