"""The assistant's pipeline: STT -> turn-taking -> LLM -> TTS, all MLX on one `ModelThread`.

    assistant = Assistant(thread, stt, llm, make_speech, History("You are ..."))
    await assistant.start(greeting=True)  # on the event loop that runs the conversation
    reply = assistant.exchange(mic_frame)  # from the audio worker, every 80 ms

The STT steps each mic frame as a real-time job (`ListenJob`), the TTS is a real-time job kept
a few frames ahead of the speaker (`SpeakJob`), and the LLM's tokens are a background job that
fills the gaps. The turn logic (`TurnTaker`) runs on the event loop, fed by the jobs' results;
its actions are carried out at once, so a barge-in drops the answer's audio before the next
frame goes to the speaker.

An app without an audio worker (`moshi_mlx.realtime`) calls `hear` with each mic frame and
`speak` when it wants the answer's next frame (`on_audio` says when one is ready), and drives
the turns itself if it likes (`commit`, `respond`, `cancel`, `clear_input`). Without an LLM
and a TTS the assistant only transcribes (its rules must not reply).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from moshi_mlx.assistant.history import History
from moshi_mlx.assistant.jobs import (
    MAX_LISTEN_BACKLOG,
    Heard,
    Listener,
    ListenJob,
    SpeakJob,
    SpeechStream,
)
from moshi_mlx.assistant.latency import LatencyLog, TurnLatency, TurnTimes
from moshi_mlx.assistant.turns import (
    Action,
    AnswerEnded,
    CloseSpeech,
    FlushStt,
    Speak,
    StartReply,
    State,
    StopReply,
    TurnRules,
    TurnTaker,
    UserSaid,
    UserStarted,
)
from moshi_mlx.errors import MoshiError, one_line
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import FRAME_SECONDS, ModelThread, ModelThreadStopped
from moshi_mlx.stt.events import WordStarted

# A mic frame louder than this (RMS, dB full scale) counts as voiced: the end of the user's
# speech, for the latency, is the last such frame before the pause head ends the turn.
VOICED_DBFS = -45.0


class ReplyModel(Protocol):
    """A chat LLM (`moshi_mlx.llm.LlmModel`)."""

    context_length: int | None

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...
    def generate(
        self,
        messages: Sequence[dict[str, str]],
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator: ...


@dataclass(frozen=True)
class ReplySampling:
    """How the LLM samples its answers."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int | None = 256


@dataclass(frozen=True)
class UserWords:
    """Words of the user, as the STT recognises them, and when each began in the STT's
    stream (seconds)."""

    text: str
    starts: tuple[float, ...] = ()


@dataclass(frozen=True)
class AssistantWords:
    """Words of the answer, as the speaker starts playing them."""

    text: str


@dataclass(frozen=True)
class AnswerText:
    """A piece of an answer written, not spoken (`Assistant.speak_answers` False), as the LLM
    writes it."""

    text: str


@dataclass(frozen=True)
class Notice:
    """Something the user should know (an LLM or TTS error), in one line."""

    text: str


# The turn-taking's actions that are events too: the user's turn begins (`UserStarted`) and
# ends (`FlushStt`), an answer starts (`StartReply`) or is stopped (`StopReply`).
Event = (
    UserWords
    | AssistantWords
    | AnswerText
    | UserSaid
    | AnswerEnded
    | TurnLatency
    | Notice
    | UserStarted
    | FlushStt
    | StartReply
    | StopReply
)


def level_dbfs(pcm: np.ndarray) -> float:
    """The frame's RMS level in dB full scale."""
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64)))) if len(pcm) else 0.0
    return 20 * np.log10(max(rms, 1e-10))


class Assistant:
    """One spoken conversation with an LLM; see the module docstring.

    `make_speech()` (run on the model thread) opens a TTS stream for one answer;
    `speaker_delay()` (run on the audio worker) is how long a frame handed over now takes
    to reach the speaker (queued frames, the device's latency; default 0). Events
    (`Event`) go to `on_event` on the event loop; `on_audio()` is called on the event loop
    when a frame of the answer is ready for `speak` (or its audio has ended).
    `max_backlog`: mic frames the STT may fall behind before the oldest are dropped.
    """

    def __init__(
        self,
        thread: ModelThread,
        stt: Listener,
        llm: ReplyModel | None,
        make_speech: Callable[[], SpeechStream] | None,
        history: History,
        *,
        rules: TurnRules | None = None,
        sampling: ReplySampling | None = None,
        on_event: Callable[[Event], None] | None = None,
        speaker_delay: Callable[[], float] | None = None,
        on_audio: Callable[[], None] | None = None,
        max_backlog: int = MAX_LISTEN_BACKLOG,
    ):
        self.thread = thread
        self.stt = stt
        self.llm = llm
        self.sampling = sampling or ReplySampling()
        limit = None
        if llm is not None and llm.context_length is not None:  # room for the answer
            limit = llm.context_length - (self.sampling.max_tokens or 256)
        counter = None if llm is None else _token_counter(llm)
        self.turns = TurnTaker(history, rules, counter, limit)
        self.latencies = LatencyLog()
        self._make_speech = make_speech
        self._on_event = on_event or (lambda event: None)
        self._speaker_delay = speaker_delay or (lambda: 0.0)
        self.listen_job = ListenJob(stt, self._heard_on_thread, max_backlog)
        on_frame = None if on_audio is None else (lambda: self._to_loop(on_audio))
        self.speak_job = SpeakJob(on_frame)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._silence = np.zeros(FRAME_SIZE, np.float32)
        self._last_voiced: float | None = None
        self._times: TurnTimes | None = None  # the turn being timed, until its answer starts
        self._timed: dict[int, TurnTimes] = {}  # answer -> its turn's times
        self._answer = 0
        # Whether answers are spoken (TTS) or only written (`AnswerText` events), and the
        # choice of the answer running now.
        self.speak_answers = make_speech is not None
        self.answer_speaks = self.speak_answers
        self._reply: asyncio.Task | None = None
        self._spare: asyncio.Future | None = None  # a TTS stream opened ahead
        self._shown = 0  # words of the current answer shown
        self._closed = False
        # The audio worker's: the answer playing and how many of its frames went out.
        self._played_answer = 0
        self._played = 0

    # --- the event loop ---
    async def start(self, greeting: bool = False) -> None:
        """Start listening (and greet the user first if `greeting`)."""
        self._loop = asyncio.get_running_loop()
        self._prepare_speech()
        self.thread.add_realtime(self.listen_job)
        self.thread.add_realtime(self.speak_job)
        if greeting:
            self._run(self.turns.greet())

    def commit(self) -> None:
        """End the user's turn now (`TurnTaker.commit`)."""
        self._run(self.turns.commit())

    def respond(self, instructions: str | None = None) -> bool:
        """Start an answer to the conversation so far (`TurnTaker.respond`); False if one
        cannot start now (the user's turn is being flushed, an answer runs, or no LLM)."""
        if self.llm is None:
            return False
        actions = self.turns.respond(instructions)
        self._run(actions)
        return bool(actions)

    def cancel(self) -> None:
        """Stop the answer running, kept in the history as far as it was heard."""
        self._run(self.turns.cancel())

    def clear_input(self) -> None:
        """Forget the user's words not yet part of a turn (the mic frames queued too)."""
        self.listen_job.clear()
        self.turns.clear()

    def renew_speech(self) -> None:
        """The TTS stream opened ahead is stale (the voice changed): open another."""
        self._drop_spare()
        self._prepare_speech()

    async def close(self) -> None:
        """Stop the jobs and wait for a step running now to end; what comes after is dropped."""
        self._closed = True
        if self._reply is not None:
            self._reply.cancel()
            await asyncio.gather(self._reply, return_exceptions=True)
        self._drop_spare()
        self.thread.remove_realtime(self.listen_job)
        self.thread.remove_realtime(self.speak_job)
        try:  # runs after the step running now: the thread does one thing at a time
            await self.thread.call(lambda: None)
        except ModelThreadStopped:
            pass

    def _run(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, FlushStt):
                now = time.monotonic()
                self._times = TurnTimes(last_voiced=self._last_voiced, end_of_turn=now)
                self.listen_job.flush(self.stt.delay_steps)
                self.thread.wake()
                self._on_event(action)
            elif isinstance(action, StartReply):
                self._answer += 1
                self._shown = 0
                if self._times is not None:
                    self._timed[self._answer] = self._times
                    self._times = None
                self.answer_speaks = self.speak_answers
                self._on_event(action)
                answering = self._answer_with(action.messages, self.answer_speaks)
                self._reply = asyncio.create_task(answering)
            elif isinstance(action, Speak | CloseSpeech):
                if self.answer_speaks:
                    self.speak_job.push(action.text, close=isinstance(action, CloseSpeech))
                self.thread.wake()
            elif isinstance(action, StopReply):
                if self._reply is not None:
                    self._reply.cancel()
                self.speak_job.stop()
                self._prepare_speech()
                self._on_event(action)
            else:
                if isinstance(action, AnswerEnded) and not action.cut_off:
                    self._prepare_speech()
                self._on_event(action)

    async def _answer_with(self, messages: list[dict[str, str]], speak: bool) -> None:
        answer = self._answer
        if speak:
            try:
                speech = await self._take_speech()
            except Exception as exc:  # noqa: BLE001 - the user is told; the next turn tries
                self._timed.pop(answer, None)
                self._on_event(Notice(f"the TTS failed: {one_line(exc)}"))
                self.turns.reply_failed()
                return
            self.speak_job.open(speech, answer)
            self.thread.wake()
        sampling = self.sampling
        written = ""  # a text answer's text so far (all of it is "heard")
        try:
            pieces = self.llm.generate(
                messages, sampling.temperature, sampling.top_p, sampling.max_tokens
            )
            async for piece in self.thread.background(pieces):
                times = self._timed.get(answer)
                if piece.text and times is not None and times.first_token is None:
                    times.first_token = time.monotonic()
                self._run(self.turns.reply_text(piece.text))
                if not speak and piece.text:
                    written += piece.text
                    self.turns.heard(written)
                    self._on_event(AnswerText(piece.text))
        except MoshiError as exc:
            self._on_event(Notice(f"the LLM failed: {one_line(exc)}"))
        self._run(self.turns.reply_ended())
        if not speak:  # written out: the answer is over
            self._timed.pop(answer, None)
            self._run(self.turns.speech_done())

    def _prepare_speech(self) -> None:
        if self._spare is None and self._make_speech is not None:
            self._spare = asyncio.wrap_future(self.thread.call_soon(self._make_speech))

    async def _take_speech(self) -> SpeechStream:
        self._prepare_speech()
        spare, self._spare = self._spare, None
        return await spare

    def _drop_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is None:
            return
        if spare.done() and not spare.cancelled():
            spare.exception()  # read: a failed stream is nobody's news now
        spare.cancel()

    def _heard(self, heard: Heard) -> None:
        if self._closed:
            return
        step = heard.step
        started = [e for e in step.events if isinstance(e, WordStarted)]
        words = [e.text for e in started]
        if heard.voiced and self.turns.state is not State.FLUSHING:
            self._last_voiced = heard.arrived
        # A barge-in ends the answer (its event first) before the user's new words show.
        self._run(self.turns.listen(step.index * FRAME_SECONDS, words, step.pause_probabilities))
        if words:
            self._on_event(UserWords(" ".join(words), tuple(e.start for e in started)))
        if heard.flush_done:
            if self._times is not None:
                self._times.flushed = time.monotonic()
            self._run(self.turns.flushed())

    def _answer_played(self, answer: int, frames: int, at_speaker: float | None) -> None:
        if self._closed or answer != self._answer or self.turns.state is not State.ANSWERING:
            return
        if at_speaker is not None and (times := self._timed.pop(answer, None)) is not None:
            times.first_audio = self.speak_job.first_audio.get(answer)
            times.at_speaker = at_speaker
            if (latency := times.latency()) is not None:
                self.latencies.add(latency)
                self._on_event(latency)
        started = [word for word, start in self.speak_job.words if start < frames * FRAME_SECONDS]
        self.turns.heard(" ".join(started))
        if len(started) > self._shown:
            self._on_event(AssistantWords(" ".join(started[self._shown :])))
            self._shown = len(started)

    def _answer_over(self, answer: int) -> None:
        if answer == self._answer and not self._closed:
            self._answer_played(answer, 1 << 30, None)
            self._run(self.turns.speech_done())

    # --- other threads ---
    def _heard_on_thread(self, heard: Heard) -> None:
        self._to_loop(self._heard, heard)

    def _to_loop(self, callback: Callable[..., None], *args: object) -> None:
        """Hand a result to the event loop; dropped once closed (or the loop is gone)."""
        if self._closed:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed
            pass

    def exchange(self, pcm: np.ndarray) -> np.ndarray:
        """A mic frame (float32 (1920,), echo removed) in, the speaker's next frame out: the
        answer's, or silence. Called by the audio worker every 80 ms."""
        self.hear(pcm)
        frame = self.speak()
        return self._silence if frame is None else frame

    def hear(self, pcm: np.ndarray) -> None:
        """A mic frame (float32 (1920,), echo removed) for the STT; from any thread."""
        pcm = np.array(pcm, np.float32)
        self.listen_job.push(pcm, level_dbfs(pcm) > VOICED_DBFS, time.monotonic())
        self.thread.wake()

    def speak(self) -> np.ndarray | None:
        """The answer's next frame for the speaker (float32 (1920,)), or None: none is
        ready. One thread only calls it (the audio worker, or the app's event loop)."""
        now = time.monotonic()
        frame, over, answer = self.speak_job.pop()
        if frame is not None:
            if answer != self._played_answer:
                self._played_answer, self._played = answer, 0
            self._played += 1
            self.thread.wake()  # the TTS may step again: a frame of its lead went
            at_speaker = now + self._speaker_delay() if self._played == 1 else None
            self._to_loop(self._answer_played, answer, self._played, at_speaker)
            return frame
        if over:
            self.speak_job.release()
            self._to_loop(self._answer_over, answer)
        return None


def _token_counter(llm: ReplyModel) -> Callable[[Sequence[dict[str, str]]], int]:
    return lambda messages: len(llm.encode_chat(messages))
