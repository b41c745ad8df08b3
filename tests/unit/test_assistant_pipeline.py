"""The assistant's pipeline on a real `ModelThread` with scripted parts: an STT that hears a
word in every loud frame and whose pause head says "done" on silence, an LLM that streams
given words, a TTS that makes three frames per word; frames are fed faster than real time."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest
from assistant_fakes import FRAMES_PER_WORD, FrameSpeech, ScriptedStt

from moshi_mlx.assistant import Assistant, History, TurnRules
from moshi_mlx.assistant.history import CUT_OFF_MARK
from moshi_mlx.assistant.latency import TurnLatency
from moshi_mlx.assistant.pipeline import AssistantWords, Notice, UserWords, level_dbfs
from moshi_mlx.assistant.turns import AnswerEnded, State, UserSaid
from moshi_mlx.llm import TextPiece
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.stt.events import SttStep, WordStarted

LOUD = np.full(FRAME_SIZE, 0.3, np.float32)
QUIET = np.zeros(FRAME_SIZE, np.float32)
ANSWER_LEVEL = 0.5


class HeldWordStt(ScriptedStt):
    """Reports each word one loud frame late and holds the last one open until
    `finish_stream`, as Kyutai's word timing does (a word is complete when the next begins)."""

    def __init__(self):
        super().__init__()
        self.held: WordStarted | None = None
        self.finished = 0

    def step(self, pcm: np.ndarray) -> SttStep:
        step = super().step(pcm)
        if not step.events:
            return step
        reported, self.held = self.held, step.events[0]
        return SttStep(step.index, (reported,) if reported else (), step.pause_probabilities)

    def finish_stream(self, stream: int) -> tuple:
        self.finished += 1
        held, self.held = self.held, None
        return (held,) if held else ()


class ScriptedLlm:
    """Streams `words` as pieces (one step each), whatever it is asked."""

    context_length = None

    def __init__(self, words: list[str]):
        self.words = words
        self.prompts: list[list[dict[str, str]]] = []
        self.closed = 0
        self.threads: set[int] = set()

    def encode_chat(self, messages):
        return [0] * sum(len(m["content"].split()) for m in messages)

    def generate(self, messages, temperature=1.0, top_p=1.0, max_tokens=None, stop=()):
        self.prompts.append(list(messages))
        return self._pieces()

    def _pieces(self):
        try:
            for word in self.words:
                self.threads.add(threading.get_ident())
                yield TextPiece(f"{word} ")
            yield TextPiece("", "stop")
        finally:
            self.closed += 1


@pytest.fixture
def thread():
    model_thread = ModelThread("test-assistant")
    model_thread.start()
    yield model_thread
    model_thread.stop()


class Harness:
    def __init__(self, thread: ModelThread, answer: list[str]):
        self.stt = ScriptedStt()
        self.llm = ScriptedLlm(answer)
        self.speeches: list[FrameSpeech] = []
        self.events: list = []
        self.assistant = Assistant(
            thread,
            self.stt,
            self.llm,
            self._speech,
            History("Be brief."),
            rules=TurnRules(ignore_start=0.0),
            on_event=self.events.append,
        )

    def _speech(self) -> FrameSpeech:
        self.speeches.append(FrameSpeech(np.full(FRAME_SIZE, ANSWER_LEVEL, np.float32)))
        return self.speeches[-1]

    async def feed(self, frame: np.ndarray, count: int) -> list[np.ndarray]:
        out = []
        for _ in range(count):
            out.append(self.assistant.exchange(frame))
            await asyncio.sleep(0.01)
        return out

    async def until(self, kind: type, timeout: float = 5.0) -> list[np.ndarray]:
        """Feed silence until an event of `kind` comes; the frames played meanwhile."""
        out = []
        for _ in range(int(timeout / 0.01)):
            if any(isinstance(e, kind) for e in self.events):
                return out
            out += await self.feed(QUIET, 1)
        raise AssertionError(f"no {kind.__name__} in {self.events}")

    async def settled(self, condition, timeout: float = 5.0) -> None:
        """Wait (feeding nothing) until `condition()` holds."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"not settled: {self.events}"
            await asyncio.sleep(0.005)


def _answer_frames(frames: list[np.ndarray]) -> int:
    return sum(bool(np.all(f == ANSWER_LEVEL)) for f in frames)


def test_a_turn_is_heard_answered_and_timed(thread):
    async def main():
        h = Harness(thread, ["Hello", "**there**", "friend!"])
        await h.assistant.start()
        await h.feed(LOUD, 3)
        played = await h.until(AnswerEnded)
        await h.assistant.close()
        return h, played

    h, played = asyncio.run(main())
    assert _answer_frames(played) == 3 * FRAMES_PER_WORD
    said = [e for e in h.events if isinstance(e, UserSaid)]
    assert said == [UserSaid("u0 u1 u2")]
    assert [e.text for e in h.events if isinstance(e, UserWords)] == ["u0", "u1", "u2"]
    shown = " ".join(e.text for e in h.events if isinstance(e, AssistantWords))
    assert shown == "Hello there friend!"
    assert h.llm.prompts[0][-1] == {"role": "user", "content": "u0 u1 u2"}
    assert h.assistant.turns.history.messages()[-1] == {
        "role": "assistant",
        "content": "Hello there friend!",
    }
    [latency] = h.assistant.latencies.turns
    assert [e for e in h.events if isinstance(e, TurnLatency)] == [latency]
    assert all(v >= 0 for v in vars(latency).values()) and latency.total < 2.0
    # Every model call ran on the model thread.
    assert h.stt.threads == h.llm.threads == h.speeches[0].threads == {thread._thread.ident}


def test_barge_in_stops_the_answer_within_one_frame_and_keeps_what_was_heard(thread):
    async def main():
        h = Harness(thread, [f"w{i}" for i in range(40)])
        await h.assistant.start()
        await h.feed(LOUD, 2)
        before = await h.until(AssistantWords)
        before += await h.feed(QUIET, 7)  # more of the answer plays
        h.assistant.exchange(LOUD)  # the user speaks over it
        # the STT step and the turn logic run: the answer ends, cut off
        await h.settled(lambda: any(isinstance(e, AnswerEnded) for e in h.events))
        after = await h.feed(QUIET, 1)
        made = h.speeches[0].frames
        await h.until(UserSaid)
        await h.feed(QUIET, 5)
        second = [e for e in h.events if isinstance(e, UserSaid)]
        await h.assistant.close()
        return h, before, after, second, made

    h, before, after, second, made = asyncio.run(main())
    assert _answer_frames(before) >= 6
    assert _answer_frames(after) == 0  # the next frame after the barge-in is silence
    assert h.speeches[0].frames == made  # and the first answer's TTS made no more
    [cut] = [e for e in h.events if isinstance(e, AnswerEnded)]
    assert cut.cut_off and cut.text.startswith("w0 w1")
    assert len(second) == 2
    # the answer ends (the screen marks it cut off) before the user's new words show
    shown = [e for e in h.events if isinstance(e, AssistantWords | UserWords | AnswerEnded)]
    first_answer_words = next(i for i, e in enumerate(shown) if isinstance(e, AssistantWords))
    after_answer = shown[first_answer_words:]
    assert isinstance(
        next(e for e in after_answer if not isinstance(e, AssistantWords)), AnswerEnded
    )
    messages = h.llm.prompts[-1]
    assert messages[-2] == {"role": "assistant", "content": cut.text + CUT_OFF_MARK}
    assert messages[-1]["role"] == "user"
    assert h.llm.closed == 2  # the first answer's generation was stopped (and the second's)


def test_the_greeting_is_spoken_before_the_user_says_anything(thread):
    async def main():
        h = Harness(thread, ["Hi!"])
        await h.assistant.start(greeting=True)
        played = await h.until(AnswerEnded)
        await h.assistant.close()
        return h, played

    h, played = asyncio.run(main())
    assert _answer_frames(played) == FRAMES_PER_WORD
    assert h.assistant.latencies.turns == []  # no user speech to time it from


def test_level_dbfs():
    assert level_dbfs(np.full(100, 0.5, np.float32)) == pytest.approx(-6.02, abs=0.01)
    assert level_dbfs(np.zeros(10, np.float32)) == -200


def test_the_last_word_held_by_the_stt_is_part_of_the_turn(thread):
    """The STT's last word of a turn comes out at the end of the flush (`finish_stream`), not
    with the user's next word."""

    async def main():
        h = Harness(thread, ["Yes."])
        h.stt = h.assistant.stt = h.assistant.listen_job.stt = HeldWordStt()
        await h.assistant.start()
        await h.feed(LOUD, 3)
        await h.until(AnswerEnded)
        await h.assistant.close()
        return h

    h = asyncio.run(main())
    assert [e for e in h.events if isinstance(e, UserSaid)] == [UserSaid("u0 u1 u2")]
    assert h.llm.prompts[0][-1] == {"role": "user", "content": "u0 u1 u2"}
    assert h.stt.finished == 1


class FailingSpeechHarness(Harness):
    """The first TTS stream fails to open (a voice file gone), the next ones open."""

    def __init__(self, thread: ModelThread, answer: list[str]):
        super().__init__(thread, answer)
        self.opened = 0

    def _speech(self) -> FrameSpeech:
        self.opened += 1
        if self.opened == 1:
            raise FileNotFoundError("no voice file\nat /voices/alice.safetensors")
        return super()._speech()


def test_a_tts_stream_that_fails_to_open_is_a_notice_and_the_turn_goes_back_to_listening(thread):
    async def main():
        h = FailingSpeechHarness(thread, ["Hello."])
        await h.assistant.start()
        await h.feed(LOUD, 2)
        await h.until(Notice)
        first = h.assistant._reply
        await h.settled(first.done)
        state, history = h.assistant.turns.state, h.assistant.turns.history.messages()
        await h.feed(LOUD, 1)  # the user goes on; this answer opens its stream
        played = await h.until(AnswerEnded)
        await h.assistant.close()
        return h, first, state, history, played

    h, first, state, history, played = asyncio.run(main())
    [notice] = [e for e in h.events if isinstance(e, Notice)]
    assert notice.text == "the TTS failed: no voice file at /voices/alice.safetensors"
    assert first.exception() is None  # the answer's task ended cleanly
    assert state is State.LISTENING
    assert [m["role"] for m in history] == ["system", "user"]  # no half answer
    # the failed turn's words and the user's next ones, as one turn
    assert h.llm.prompts[-1][1:] == [{"role": "user", "content": "u0 u1 u2"}]
    assert _answer_frames(played) == FRAMES_PER_WORD
    assert len(h.assistant.latencies.turns) == 1  # the answered turn's


class SlowStt(ScriptedStt):
    """Its loud steps take 0.3 s; `stepping` is set while one runs."""

    def __init__(self):
        super().__init__()
        self.stepping = threading.Event()
        self.ended = 0.0

    def step(self, pcm: np.ndarray) -> SttStep:
        if not pcm.any():
            return super().step(pcm)
        self.stepping.set()
        time.sleep(0.3)
        self.ended = time.monotonic()
        return super().step(pcm)


def test_close_waits_for_the_running_step_and_drops_its_result(thread, caplog):
    """`close()` returns after the step running then; its result, arriving after the close,
    is dropped (no event, no 'event loop is closed' error once the loop has gone)."""

    async def main():
        h = Harness(thread, ["Hi."])
        h.stt = h.assistant.stt = h.assistant.listen_job.stt = SlowStt()
        await h.assistant.start()
        h.assistant.exchange(LOUD)
        await asyncio.to_thread(h.stt.stepping.wait, 5)
        await h.assistant.close()
        return h, time.monotonic()

    with caplog.at_level(logging.WARNING, logger="moshi_mlx"):
        h, closed = asyncio.run(main())
        thread.call_soon(lambda: None).result(5)  # anything still running on the thread ended
    assert 0 < h.stt.ended <= closed
    assert not any(isinstance(e, UserWords) for e in h.events)
    assert [r.getMessage() for r in caplog.records] == []
