"""The `assistant` part: the spoken assistant's latency split per turn (`moshi_mlx.assistant`)
on tiny random models, beside what each model costs alone, so that the orchestration's own
overhead is a number.

The real `Assistant` runs with a real tiny STT (shape `stt-tiny`, random full-size Mimi through
rustymimi), a real tiny TTS (`tts-tiny`, random full-size Mimi) and a real tiny mlx-lm LLM
(`moshi_mlx.testing.llm`, greedy), all on one `ModelThread`. Random weights hear no words and
never end a turn, so the STT's step runs for its cost and its result is scripted: a word on
each loud mic frame, its pause head "done" on quiet ones (the end of the turn fires on the
first quiet frame, as Unmute's rule reads the head). Each turn: `USER_FRAMES` loud frames,
then quiet ones until the answer is played out.

Mic frames come every `frame_ms`: 80 ms where the models keep up (an STT step and a TTS frame
within a frame), else slower, so that the model thread is never behind and the split is the
pipeline's, not a backlog's.

Per turn, the split (`moshi_mlx.assistant.latency`): detection (scripted), STT flush, LLM first
token, TTS first audio, audio out (waiting for the next frame's tick: pacing). Alone: an STT
step, the LLM's first token and later tokens on the same prompts (replayed in order on a second
copy, so its prompt cache holds what the pipeline's held), the TTS's first audio for the same
answer text (whole, on a fresh stream) and a TTS frame. The overhead of a turn: the wall time
from the end of the turn to the answer's first audio that the model thread did not spend in a
model call (STT step, LLM step, TTS stream made, fed or stepped), i.e. event-loop hops, thread
wake-ups and the pipeline's own Python.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from moshi_mlx.assistant import Assistant, History, ReplySampling, TurnRules
from moshi_mlx.assistant.latency import STAGES, TurnLatency
from moshi_mlx.assistant.speech_text import SpokenWords
from moshi_mlx.assistant.turns import AnswerEnded
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.stt.events import SttStep, WordStarted

from ..part import Part
from ..shapes import LM_SHAPES
from ..weights import TTS_LM_FILE, TTS_TOKENIZER, lm_weights, mimi_weights, tts_weights

STT_SHAPE, TTS_SHAPE = "stt-tiny", "tts-tiny"
USER_FRAMES = 6  # loud frames of each user turn (a word each)
USER_WORDS = ("what", "time", "is", "it", "in", "Paris")
MAX_TOKENS = 12  # the LLM's answers: a few words
SYSTEM = "You are a helpful voice assistant. Answer in one short sentence."
ALONE_STT_STEPS = 20
Intervals = list[tuple[float, float]]  # (start, end) of each model call, monotonic seconds


class _ScriptedStt:
    """The real STT's step, timed; its words and pause head scripted (see the module)."""

    def __init__(self, stt, calls: Intervals):
        self._stt = stt
        self._calls = calls
        self.delay_steps = stt.delay_steps
        self._words = 0

    def step(self, pcm: np.ndarray) -> SttStep:
        start = time.monotonic()
        step = self._stt.step(pcm)
        self._calls.append((start, time.monotonic()))
        if not pcm.any():
            return replace(step, events=(), pause_probabilities=(0.0, 0.0, 0.95, 0.0))
        word = USER_WORDS[self._words % len(USER_WORDS)]
        self._words += 1
        event = WordStarted(word, step.index * 0.08)
        return replace(step, events=(event,), pause_probabilities=(0.0, 0.0, 0.01, 0.0))

    def finish_stream(self, stream: int) -> tuple:
        """The scripted words are reported at once: none is left open at a flush's end."""
        return ()


class _TimedLlm:
    """The LLM, each of its steps timed; the prompts it was given kept."""

    def __init__(self, llm, calls: Intervals):
        self._llm = llm
        self._calls = calls
        self.context_length = llm.context_length
        self.prompts: list[list[dict[str, str]]] = []

    def encode_chat(self, messages):
        return self._llm.encode_chat(messages)

    def generate(self, messages, temperature=1.0, top_p=1.0, max_tokens=None, stop=()):
        self.prompts.append(list(messages))
        pieces = self._llm.generate(messages, temperature, top_p, max_tokens, stop)
        return _timed_iterator(pieces, self._calls)


class _SpeechProxy:
    """A TTS stream passed through (`push`, `close`, `steps`, `words`, `waiting`), for the
    parts' streams that note when things happen."""

    def __init__(self, speech):
        self._speech = speech

    @property
    def words(self):
        return self._speech.words

    @property
    def waiting(self) -> bool:
        return self._speech.waiting

    def push(self, text: str) -> None:
        self._speech.push(text)

    def close(self) -> None:
        self._speech.close()

    def steps(self):
        return self._speech.steps()


class _TimedSpeech(_SpeechProxy):
    """A TTS stream whose feeding and steps are timed."""

    def __init__(self, speech, calls: Intervals):
        super().__init__(speech)
        self._calls = calls

    def push(self, text: str) -> None:
        start = time.monotonic()
        self._speech.push(text)
        self._calls.append((start, time.monotonic()))

    def steps(self):
        return _timed_iterator(self._speech.steps(), self._calls)


def _timed_iterator(items, calls: Intervals):
    while True:
        start = time.monotonic()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            calls.append((start, time.monotonic()))
        yield item


def _busy(calls: Intervals, start: float, end: float) -> float:
    """Seconds of `calls` within [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in calls)


def _load(folder: Path, thread: ModelThread) -> dict:
    """The three tiny models, loaded and warmed on `thread`; a second LLM for the alone runs."""
    from moshi_mlx.llm import LlmModel
    from moshi_mlx.stt.transcriber import SttModel
    from moshi_mlx.testing.llm import write_tiny_llm
    from moshi_mlx.tts.synthesizer import TtsModel

    mimi = mimi_weights(folder)
    tts_dir = tts_weights(folder, TTS_SHAPE, voices=1)
    stt_config = folder / f"{STT_SHAPE}.json"
    stt_config.write_text(json.dumps(LM_SHAPES[STT_SHAPE]))
    llm_dir = folder / "llm-tiny"
    if not (llm_dir / "config.json").exists():
        write_tiny_llm(llm_dir)

    def load() -> dict:
        models = {
            "stt": SttModel.load(
                moshi_weight=lm_weights(folder, STT_SHAPE, "bf16"),
                mimi_weight=mimi,
                tokenizer=tts_dir / TTS_TOKENIZER,
                lm_config=stt_config,
                codec_backend="rustymimi",
            ),
            "tts": TtsModel.load(
                moshi_weight=tts_dir / TTS_LM_FILE,
                mimi_weight=mimi,
                tokenizer=tts_dir / TTS_TOKENIZER,
                lm_config=tts_dir / "config.json",
            ),
            "llm": LlmModel.load(llm_dir),
            "llm_alone": LlmModel.load(llm_dir),
            "voice": tts_dir / "voices" / "voice0.safetensors",
        }
        for llm in (models["llm"], models["llm_alone"]):  # as the CLI warms its LLM up
            warm = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            for _ in llm.generate(warm, max_tokens=1):
                pass
        return models

    return thread.call_soon(load).result()


def _stt_alone(models: dict, steps: int) -> list[float]:
    stream = models["stt"].speech_to_text()
    rng = np.random.default_rng(0)
    times = []
    for index in range(steps + 3):
        pcm = rng.normal(0, 0.1, FRAME_SIZE).astype(np.float32)
        start = time.monotonic()
        stream.step(pcm)
        if index >= 3:
            times.append(time.monotonic() - start)
    return times


def _tts_alone(models: dict, text: str, frames: int = 4) -> tuple[float, list[float]]:
    """(seconds from pushing `text` whole to its first audio, seconds of the frames after)."""
    speech = models["tts"].stream(voice=models["voice"])
    pushed = last = time.monotonic()
    speech.push(text)
    speech.close()
    first, after = None, []
    for step in speech.steps():
        now = time.monotonic()
        if first is not None:
            after.append(now - last)
            if len(after) == frames:
                break
        elif step.pcm[0] is not None:
            first = now - pushed
        last = now
    return first, after


def _llm_alone(models: dict, prompts: list, sampling: ReplySampling) -> list[dict]:
    """Per prompt, replayed in order: seconds to the first text, per later token, and to the
    first whole word (what the TTS waits for)."""
    results = []
    for messages in prompts:
        start = last = time.monotonic()
        first_text = first_word = None
        tokens = []
        words = SpokenWords()
        for piece in models["llm_alone"].generate(
            messages, sampling.temperature, sampling.top_p, sampling.max_tokens
        ):
            now = time.monotonic()
            if first_text is None and piece.text:
                first_text = now - start
            elif first_text is not None:
                tokens.append(now - last)
            if first_word is None and words.add(piece.text):
                first_word = now - start
            last = now
        results.append({"first_token": first_text, "first_word": first_word, "tokens": tokens})
    return results


def _frame_seconds(stt_step: float, tts_frame: float) -> float:
    """80 ms, or slower where an STT step and a TTS frame do not fit in 80 ms with room for
    the LLM (the model thread must not fall behind)."""
    return max(0.08, 2.0 * (stt_step + tts_frame))


async def _converse(assistant: Assistant, turns: int, frame_seconds: float, events: list):
    loud = np.random.default_rng(1).normal(0, 0.1, FRAME_SIZE).astype(np.float32)
    quiet = np.zeros(FRAME_SIZE, np.float32)
    loop = asyncio.get_running_loop()
    await assistant.start(greeting=False)
    tick = loop.time()
    deadline = tick + turns * (60 + 200 * frame_seconds)
    for turn in range(turns):
        frames = 0
        while sum(isinstance(e, AnswerEnded) for e in events) <= turn:
            assistant.exchange(loud if frames < USER_FRAMES else quiet)
            frames += 1
            tick += frame_seconds
            await asyncio.sleep(max(0.0, tick - loop.time()))
            if loop.time() > deadline:
                raise RuntimeError(f"turn {turn + 1} got no answer: {events[-5:]}")
    await assistant.close()


def _measure(thread: ModelThread, folder: Path, turns: int, held: dict) -> dict:
    """The run's raw figures; every object holding MLX arrays goes into `held` (dropped on
    the model thread: MLX objects freed on another thread at exit abort the process)."""
    models = held["models"] = _load(folder, thread)
    stt_alone = thread.call_soon(lambda: _stt_alone(models, ALONE_STT_STEPS)).result()
    probe = thread.call_soon(lambda: _tts_alone(models, "Hello there, how are you?"))
    tts_frames = probe.result()[1]
    frame_seconds = _frame_seconds(float(np.median(stt_alone)), float(np.median(tts_frames)))
    calls: Intervals = []
    llm = _TimedLlm(models["llm"], calls)
    sampling = ReplySampling(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS)
    stt = held["stt"] = thread.call_soon(models["stt"].speech_to_text).result()
    events: list = []

    def make_speech():
        start = time.monotonic()
        speech = models["tts"].stream(voice=models["voice"])
        calls.append((start, time.monotonic()))
        return _TimedSpeech(speech, calls)

    assistant = held["assistant"] = Assistant(
        thread,
        _ScriptedStt(stt, calls),
        llm,
        make_speech,
        History(SYSTEM),
        rules=TurnRules(ignore_start=0.0),
        sampling=sampling,
        on_event=events.append,
    )
    asyncio.run(_converse(assistant, turns, frame_seconds, events))
    answers = [e.text for e in events if isinstance(e, AnswerEnded)]
    return {
        "frame_seconds": frame_seconds,
        "stt_alone": stt_alone,
        "tts_frames": tts_frames,
        "delay_steps": stt.delay_steps,
        "calls": calls,
        "latencies": [e for e in events if isinstance(e, TurnLatency)],
        "first_audio": dict(assistant.speak_job.first_audio),
        "dropped": assistant.listen_job.dropped_frames,
        "llm_alone": thread.call_soon(lambda: _llm_alone(models, llm.prompts, sampling)).result(),
        "tts_alone": [
            thread.call_soon(lambda t=t: _tts_alone(models, t)).result() for t in answers
        ],
    }


def _drop(held: dict) -> None:
    held.clear()
    gc.collect()


def bench_assistant(folder: Path, turns: int) -> dict:
    """The split of `turns` turns through the real pipeline, and the parts alone."""
    thread = ModelThread("bench-assistant")
    thread.start()
    held: dict = {}
    try:
        raw = _measure(thread, folder, turns, held)
    finally:
        thread.call_soon(lambda: _drop(held)).result()
        thread.stop()
    stt_step = float(np.median(raw["stt_alone"]))
    result = {
        "frame_ms": 1000 * raw["frame_seconds"],
        "stt_step_ms": 1000 * stt_step,
        "tts_frame_ms": 1000 * float(np.median(raw["tts_frames"])),
        "dropped_mic_frames": raw["dropped"],
        "turns": [],
    }
    for index, latency in enumerate(raw["latencies"]):
        end = raw["first_audio"][index + 1]  # answers count from 1; no greeting
        start = end - (latency.stt_flush + latency.llm_first_token + latency.tts_first_audio)
        alone = raw["llm_alone"][index]
        turn = {stage: 1000 * getattr(latency, stage) for stage in STAGES}
        turn.update(
            total=1000 * latency.total,
            window=1000 * (end - start),
            model_busy=1000 * _busy(raw["calls"], start, end),
            llm_first_token_alone=1000 * alone["first_token"],
            llm_first_word_alone=1000 * (alone["first_word"] or float("nan")),
            llm_token_alone=1000 * float(np.median(alone["tokens"] or [np.nan])),
            tts_first_audio_alone=1000 * raw["tts_alone"][index][0],
            stt_flush_alone=1000 * raw["delay_steps"] * stt_step,
        )
        turn["overhead"] = turn["window"] - turn["model_busy"]
        result["turns"].append(turn)
    overheads = [t["overhead"] for t in result["turns"]]
    result["overhead_ms_median"] = float(np.median(overheads)) if overheads else None
    return result


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    yield {
        "part": "assistant",
        "shape": f"{STT_SHAPE}+{TTS_SHAPE}+llm-tiny",
        "ours": bench_assistant(folder, args.turns),
    }


def summary(case: dict) -> str:
    """A line per turn (the split, the window and its model time), and the parts alone."""
    ours = case["ours"]
    head = (
        f"assistant {case['shape']}: mic frames every {ours['frame_ms']:.0f} ms; alone: STT "
        f"step {ours['stt_step_ms']:.0f} ms, TTS frame {ours['tts_frame_ms']:.0f} ms; "
        f"{ours['dropped_mic_frames']} mic frames dropped"
    )
    lines = [head]
    for number, turn in enumerate(ours["turns"], 1):
        split = ", ".join(f"{stage} {turn[stage]:.0f}" for stage in STAGES)
        lines.append(
            f"  turn {number}: total {turn['total']:.0f} ms ({split}); alone: STT flush "
            f"{turn['stt_flush_alone']:.0f}, LLM first token {turn['llm_first_token_alone']:.0f} "
            f"(first word {turn['llm_first_word_alone']:.0f}, then "
            f"{turn['llm_token_alone']:.1f}/token), TTS first audio "
            f"{turn['tts_first_audio_alone']:.0f}; end of turn -> first audio "
            f"{turn['window']:.0f} ms, of which models {turn['model_busy']:.0f}, "
            f"orchestration {turn['overhead']:.1f} ms"
        )
    if ours["overhead_ms_median"] is not None:
        lines.append(f"  orchestration overhead: median {ours['overhead_ms_median']:.1f} ms a turn")
    return "\n".join(lines)


PART = Part("assistant", cases, summary=summary)
