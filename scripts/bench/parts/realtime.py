"""The `realtime` part: `/v1/realtime`'s latency per turn, end to end through a websocket, on
the assistant part's tiny models, and what the socket and event layer adds per frame.

A server on loopback runs the route's connection (`serve.realtime.connection`) and session
(`moshi_mlx.realtime`) over the real tiny STT (its words and pause head scripted, as the
assistant part does), LLM and TTS; a websocket client sends mic frames as JSON appends, paced
every `frame_ms` (80 ms where the models keep up, else slower, as the assistant part paces
them), `USER_FRAMES` loud ones then quiet ones until the answer is done.

Per turn, from the client's clock: the end of the user's speech (the last loud frame sent) ->
`input_audio_buffer.speech_stopped` -> the first `response.output_audio.delta`; the engine's
split (`moshi_mlx.assistant.latency`: detection, STT flush, LLM first token, TTS first audio,
audio out); the first frame's way from the TTS step that made it to the client (event loop,
encoding, JSON, socket). For every audio delta: the time from the session's emit to the
client's receipt (JSON and socket).

Moshi's full duplex end to end (`MOSHI_FRAMES` frames): a random Moshi of the first of
`--shapes` in the first of `--quant` (by default `tiny` in bf16; the GPU suite: `7b` q4), the
full-size random Mimi through rustymimi) behind the same connection, a `DuplexSession` on
the model thread; the client sends one mic frame at a time and times it to the reply frame it
produced, and each frame's model step is timed inside: the difference is what the socket, the
events and the thread hops add to a frame.

Moshi's full duplex through the same socket, the model aside: a client sends each mic frame as
an append, the server's `DuplexRealtimeSession` hands it to a conversation that answers at once
with a frame (an echo, standing for Moshi's step), and the client times the frame's way there
and back as an audio delta (`ECHO_FRAMES` frames, one at a time): what the socket and event
layer adds to each of Moshi's frames.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from moshi_mlx.assistant import ReplySampling, TurnRules
from moshi_mlx.assistant.latency import STAGES
from moshi_mlx.realtime import RealtimeSession, SessionConfig, SessionParts
from moshi_mlx.realtime.duplex import DuplexRealtimeSession
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.realtime.connection import MAX_MESSAGE_BYTES, RealtimeConnection

from ..part import Part
from .assistant import (
    ALONE_STT_STEPS,
    MAX_TOKENS,
    SYSTEM,
    USER_FRAMES,
    _drop,
    _frame_seconds,
    _load,
    _ScriptedStt,
    _SpeechProxy,
    _stt_alone,
    _tts_alone,
)

ECHO_FRAMES = 200
MOSHI_FRAMES = 30


class _EchoDuplex:
    """A full-duplex conversation that answers each frame at once with that frame."""

    def __init__(self, _voice, _role):
        self._replies: asyncio.Queue = asyncio.Queue()

    async def start(self) -> int:
        return 0

    def push(self, frame: np.ndarray) -> None:
        self._replies.put_nowait(frame)

    async def next(self):
        frame = await self._replies.get()
        if frame is None:
            from moshi_mlx.errors import MoshiError

            raise MoshiError("closed")
        return _Reply(frame, "")

    def close(self) -> None:
        self._replies.put_nowait(None)


class _Reply:
    def __init__(self, pcm: np.ndarray, text: str):
        self.pcm, self.text = pcm, text


async def _serve_route(make_session) -> tuple[web.AppRunner, str]:
    """`/v1/realtime`'s connection over `make_session(emit)` on loopback: (runner, ws url)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        await RealtimeConnection(ws, make_session, Limits()).run()
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"ws://127.0.0.1:{runner.addresses[0][1]}/v1/realtime"


async def _frame_round_trips(url: str, frames: int, seed: int) -> list[float]:
    """Seconds from each mic frame sent (a JSON append) to its reply delta received, one frame
    at a time."""
    rng = np.random.default_rng(seed)
    trips = []
    async with aiohttp.ClientSession() as client, client.ws_connect(url) as ws:
        for _ in range(frames):
            pcm = (0.1 * rng.standard_normal(FRAME_SIZE)).astype(np.float32)
            data = base64.b64encode((pcm * 32767).astype("<i2").tobytes()).decode()
            start = time.perf_counter()
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": data}))
            while json.loads((await ws.receive(timeout=60)).data)["type"] != (
                "response.output_audio.delta"
            ):
                pass
            trips.append(time.perf_counter() - start)
    return trips


async def _echo_round_trips(frames: int) -> list[float]:
    """Seconds from each mic frame sent to its reply delta received, one frame at a time."""

    async def make_session(emit):
        return DuplexRealtimeSession(_EchoDuplex, SessionConfig(model="echo"), emit)

    runner, url = await _serve_route(make_session)
    try:
        return await _frame_round_trips(url, frames, seed=2)
    finally:
        await runner.cleanup()


class _FirstFrames(_SpeechProxy):
    """A TTS stream that notes when its first frame was made (monotonic s)."""

    def __init__(self, speech, made: list[float]):
        super().__init__(speech)
        self._made = made

    def steps(self):
        first = True
        for step in self._speech.steps():
            if first and step.pcm[0] is not None:
                self._made.append(time.monotonic())
                first = False
            yield step


async def _serve(thread: ModelThread, parts: SessionParts, sessions: list, emitted: dict):
    """The route's connection and session on loopback: (runner, ws url)."""

    async def make_session(emit):
        def stamped(event: dict) -> None:
            if event["type"] == "response.output_audio.delta":
                emitted[event["event_id"]] = time.monotonic()
            emit(event)

        rules = TurnRules(ignore_start=0.0)
        sampling = ReplySampling(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS)
        config = SessionConfig(model="tiny", instructions=SYSTEM)
        session = RealtimeSession(thread, parts, config, stamped, rules, sampling)
        sessions.append(session)
        return session

    return await _serve_route(make_session)


async def _converse(url: str, turns: int, frame_seconds: float, received: dict) -> list[dict]:
    """The client's side: per turn the monotonic times of its milestones."""
    loud = np.random.default_rng(1).normal(0, 0.1, FRAME_SIZE).astype(np.float32)
    quiet = np.zeros(FRAME_SIZE, np.float32)

    def append(pcm: np.ndarray) -> str:
        data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
        return json.dumps(
            {"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}
        )

    timeline: list[dict] = []
    async with aiohttp.ClientSession() as client, client.ws_connect(url) as ws:

        async def read() -> None:
            async for message in ws:
                event = json.loads(message.data)
                now = time.monotonic()
                if event["type"] == "response.output_audio.delta":
                    received[event["event_id"]] = now
                    timeline[-1].setdefault("first_audio", now)
                elif event["type"] == "input_audio_buffer.speech_stopped":
                    timeline[-1].setdefault("speech_stopped", now)
                elif event["type"] == "response.done" and timeline:
                    timeline[-1]["done"] = now

        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        tick = loop.time()
        for _ in range(turns):
            timeline.append({})
            frames = 0
            deadline = loop.time() + 60 + 200 * frame_seconds
            while "done" not in timeline[-1]:
                await ws.send_str(append(loud if frames < USER_FRAMES else quiet))
                if frames == USER_FRAMES - 1:
                    timeline[-1]["speech_end"] = time.monotonic()
                frames += 1
                tick += frame_seconds
                await asyncio.sleep(max(0.0, tick - loop.time()))
                if loop.time() > deadline:
                    raise RuntimeError(f"no answer to turn {len(timeline)}")
        reader.cancel()
    return timeline


def bench_realtime(folder: Path, turns: int) -> dict:
    """The figures of `turns` spoken turns through the websocket."""
    thread = ModelThread("bench-realtime")
    thread.start()
    held: dict = {}
    try:
        models = held["models"] = _load(folder, thread)
        stt_alone = thread.call_soon(lambda: _stt_alone(models, ALONE_STT_STEPS)).result()
        probe = thread.call_soon(lambda: _tts_alone(models, "Hello there, how are you?"))
        tts_frames = probe.result()[1]
        frame_seconds = _frame_seconds(float(np.median(stt_alone)), float(np.median(tts_frames)))
        stt = held["stt"] = thread.call_soon(models["stt"].speech_to_text).result()
        made: list[float] = []

        def open_speech(_voice) -> _FirstFrames:  # the part's one voice, whatever is asked
            return _FirstFrames(models["tts"].stream(voice=models["voice"]), made)

        parts = SessionParts(_ScriptedStt(stt, []), models["llm"], open_speech)
        sessions: list[RealtimeSession] = []
        emitted: dict[str, float] = {}
        received: dict[str, float] = {}

        async def run():
            runner, url = await _serve(thread, parts, sessions, emitted)
            try:
                return await _converse(url, turns, frame_seconds, received)
            finally:
                await runner.cleanup()

        timeline = asyncio.run(run())
        latencies = list(sessions[0].assistant.latencies.turns)
    finally:
        thread.call_soon(lambda: _drop(held)).result()
        thread.stop()
    socket_ms = [1000 * (received[key] - emitted[key]) for key in received if key in emitted]
    result = {"frame_ms": 1000 * frame_seconds, "turns": [], "deltas": len(socket_ms)}
    for index, marks in enumerate(timeline):
        turn = {
            "speech_stopped": 1000 * (marks["speech_stopped"] - marks["speech_end"]),
            "first_audio_delta": 1000 * (marks["first_audio"] - marks["speech_end"]),
            "first_frame_to_client": 1000 * (marks["first_audio"] - made[index]),
        }
        if index < len(latencies):
            turn.update({stage: 1000 * getattr(latencies[index], stage) for stage in STAGES})
        result["turns"].append(turn)
    result["socket_ms_median"] = float(np.median(socket_ms))
    result["socket_ms_p95"] = float(np.percentile(socket_ms, 95))
    result["first_frame_to_client_ms_median"] = float(
        np.median([t["first_frame_to_client"] for t in result["turns"]])
    )
    return result


def _load_moshi(folder: Path, shape: str, quant: str):
    from bench_stats import LM_SHAPES

    from moshi_mlx.chat.model import MoshiModel
    from moshi_mlx.models.config import LmConfig

    from ..weights import TTS_TOKENIZER, lm_weights, mimi_weights, tts_weights

    return MoshiModel.load(
        moshi_weight=lm_weights(folder, shape, quant),
        mimi_weight=mimi_weights(folder),
        tokenizer=tts_weights(folder, "tts-tiny", voices=1) / TTS_TOKENIZER,
        lm_config=LmConfig.from_dict(LM_SHAPES[shape]),
        codec_backend="rustymimi",
    )


class _TimedConversation:
    """A Moshi conversation whose steps are timed (seconds, in `steps`)."""

    def __init__(self, conversation, steps: list[float]):
        self._conversation = conversation
        self._steps = steps
        self.seed = conversation.seed

    def step(self, pcm: np.ndarray):
        start = time.perf_counter()
        reply = self._conversation.step(pcm)
        self._steps.append(time.perf_counter() - start)
        return reply

    def close(self) -> None:
        self._conversation.close()


class _TimedModel:
    """A MoshiModel whose conversations time their steps."""

    def __init__(self, model, steps: list[float]):
        self._model = model
        self._steps = steps

    def conversation(self, **options):
        return _TimedConversation(self._model.conversation(**options), self._steps)


async def _moshi_round_trips(thread, model, frames: int) -> tuple[list[float], list[float]]:
    """(seconds from each mic frame sent to Moshi's reply frame received, one frame at a
    time; seconds of each frame's model step)."""
    from moshi_mlx.chat.duplex import DuplexSession

    steps: list[float] = []
    timed = _TimedModel(model, steps)

    def open_duplex(_voice, _role):
        return DuplexSession(thread, timed, seed=1, max_lag_frames=frames + 10)

    async def make_session(emit):
        return DuplexRealtimeSession(open_duplex, SessionConfig(model="moshi"), emit)

    runner, url = await _serve_route(make_session)
    try:
        return await _frame_round_trips(url, frames, seed=4), steps
    finally:
        await runner.cleanup()


def bench_moshi(folder: Path, shape: str, quant: str, frames: int = MOSHI_FRAMES) -> dict:
    """Moshi's (`shape`, `quant`) mic frame -> reply frame through the socket (ms), one frame
    at a time, less that frame's model step: what the socket, the events and the thread hops
    add."""
    thread = ModelThread("bench-realtime-moshi")
    thread.start()
    held: dict = {}
    try:
        model = held["model"] = thread.call_soon(lambda: _load_moshi(folder, shape, quant)).result()
        trips, steps = asyncio.run(_moshi_round_trips(thread, model, frames + 5))
    finally:
        thread.call_soon(lambda: _drop(held)).result()
        thread.stop()
    trips_ms = 1000 * np.array(trips[5:])  # 5 warm-up frames
    added_ms = trips_ms - 1000 * np.array(steps[5 : len(trips)])
    return {
        "shape": shape,
        "quant": quant,
        "frames": len(trips_ms),
        "step_ms_median": float(np.median(1000 * np.array(steps[5:]))),
        "round_trip_ms_median": float(np.median(trips_ms)),
        "round_trip_ms_p95": float(np.percentile(trips_ms, 95)),
        "added_ms_median": float(np.median(added_ms)),
        "added_ms_p95": float(np.percentile(added_ms, 95)),
    }


def bench_duplex_layer(frames: int = ECHO_FRAMES) -> dict:
    """The socket and event layer's round trip per full-duplex frame (ms), the model aside."""
    trips = 1000 * np.array(asyncio.run(_echo_round_trips(frames + 10))[10:])  # 10 warm-up
    return {
        "frames": frames,
        "round_trip_ms_median": float(np.median(trips)),
        "round_trip_ms_p95": float(np.percentile(trips, 95)),
    }


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    yield {
        "part": "realtime",
        "shape": "stt-tiny+tts-tiny+llm-tiny",
        "ours": bench_realtime(folder, args.turns),
        "duplex_layer": bench_duplex_layer(),
        "moshi": bench_moshi(folder, args.shapes[0], args.quant[0]),
    }


def summary(case: dict) -> str:
    """A line per turn, and the layer's cost per frame."""
    ours = case["ours"]
    lines = [f"realtime {case['shape']}: mic appends every {ours['frame_ms']:.0f} ms"]
    for number, turn in enumerate(ours["turns"], 1):
        split = ", ".join(f"{stage} {turn[stage]:.0f}" for stage in STAGES if stage in turn)
        lines.append(
            f"  turn {number}: speech end -> speech_stopped {turn['speech_stopped']:.0f} ms, "
            f"-> first audio delta {turn['first_audio_delta']:.0f} ms ({split} ms); first "
            f"frame made -> client {turn['first_frame_to_client']:.1f} ms"
        )
    lines.append(
        f"  socket and event layer: first frame made -> client median "
        f"{ours['first_frame_to_client_ms_median']:.1f} ms; each audio delta emit -> client "
        f"median {ours['socket_ms_median']:.1f} ms, p95 {ours['socket_ms_p95']:.1f} ms "
        f"({ours['deltas']} deltas)"
    )
    layer = case["duplex_layer"]
    lines.append(
        f"  Moshi full duplex, the model aside (an echo): mic frame -> reply frame through the "
        f"socket median {layer['round_trip_ms_median']:.1f} ms, p95 "
        f"{layer['round_trip_ms_p95']:.1f} ms ({layer['frames']} frames)"
    )
    moshi = case["moshi"]
    lines.append(
        f"  Moshi full duplex ({moshi['shape']}, one frame at a time): mic frame -> its reply "
        f"frame through the socket median {moshi['round_trip_ms_median']:.0f} ms, p95 "
        f"{moshi['round_trip_ms_p95']:.0f} ms ({moshi['frames']} frames), of which the step "
        f"{moshi['step_ms_median']:.0f} ms; added by socket, events and thread hops median "
        f"{moshi['added_ms_median']:.1f} ms, p95 {moshi['added_ms_p95']:.1f} ms"
    )
    return "\n".join(lines)


PART = Part("realtime", cases, summary=summary)
