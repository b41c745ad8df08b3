"""Helpers of the `/v1/realtime` tests: a guarded server with scripted parts (an STT that hears
a word in every loud frame and whose pause head says "done" on quiet ones, an LLM that streams
given words, a TTS that plays three frames of a tone per word), audio in the protocol's
format, and each server event checked against the `openai` package's types."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import typing
from types import SimpleNamespace

import numpy as np
import openai
from assistant_fakes import FrameSpeech, ScriptedStt
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from served_app import served, with_routes

from moshi_mlx.assistant import TurnRules
from moshi_mlx.errors import MoshiError
from moshi_mlx.llm import TextPiece
from moshi_mlx.realtime import SessionError, SessionParts
from moshi_mlx.realtime.config import DEFAULT_VOICE_NAME
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.realtime import server
from moshi_mlx.serve.realtime.server import RealtimeOptions

_TIME = np.arange(FRAME_SIZE) / SAMPLE_RATE
LOUD = (0.3 * np.sin(2 * np.pi * 440 * _TIME)).astype(np.float32)
QUIET = np.zeros(FRAME_SIZE, np.float32)
TONE = (0.5 * np.sin(2 * np.pi * 330 * _TIME)).astype(np.float32)
ANSWER = ["Paris", "is", "**lovely**."]
LONG_ANSWER = [f"word{i}" for i in range(40)]
MODELS = {"llm": "scripted-llm", "stt": "scripted-stt", "tts": "scripted-tts",
          "moshi": "scripted-moshi"}  # fmt: skip

WAIT = 30.0  # seconds any one event may take on a loaded machine
NO_VOICE = "this server has no default voice: name one"

_MODELS_OF_TYPE = {
    typing.get_args(model.model_fields["type"].annotation)[0]: model
    for model in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}


def checked(event: dict) -> dict:
    """`event`, after the `openai` package's type of its kind has validated it (required
    fields, types, literals)."""
    _MODELS_OF_TYPE[event["type"]].model_validate(event)
    return event


def pcm16(frames: list[np.ndarray]) -> str:
    """Frames as base64 pcm16 (24 kHz), as `input_audio_buffer.append` takes it."""
    pcm = np.concatenate(frames)
    return base64.b64encode((pcm * 32767).astype("<i2").tobytes()).decode()


class ScriptedLlm:
    """`words` to every prompt (each a piece), then "stop"; records the prompts."""

    context_length = None

    def __init__(self, words: list[str]):
        self.words = words
        self.prompts: list[list[dict[str, str]]] = []

    def encode_chat(self, messages):
        return [0] * sum(len(m["content"].split()) for m in messages)

    def generate(self, messages, temperature=1.0, top_p=1.0, max_tokens=None, stop=()):
        self.prompts.append(list(messages))
        return iter([*(TextPiece(f"{word} ") for word in self.words), TextPiece("", "stop")])


class FakeDuplex:
    """A full-duplex conversation that answers each mic frame with a frame of `TONE` and,
    every third frame, a word (`m0 `, `m1 `, ...); records its persona and frames."""

    def __init__(self, voice, role):
        self.persona = (voice, role)
        self.frames = 0
        self.closed = False
        self._replies: asyncio.Queue = asyncio.Queue()

    async def start(self) -> int:
        return 0

    def push(self, frame: np.ndarray) -> None:
        assert frame.shape == (FRAME_SIZE,)
        text = f"m{self.frames // 3} " if self.frames % 3 == 0 else ""
        self.frames += 1
        self._replies.put_nowait(SimpleNamespace(pcm=TONE.copy(), text=text))

    async def next(self):
        reply = await self._replies.get()
        if reply is None:
            raise MoshiError("the session is closed")
        return reply

    def close(self) -> None:
        self.closed = True
        self._replies.put_nowait(None)


class Parts:
    """The scripted parts of each session; `llm` is the last session's LLM, `duplexes` the
    Moshi conversations opened; sessions start in `voice` (None: none, as on a TTS of
    cloned voices only, refused with `NO_VOICE` until one is set)."""

    def __init__(self):
        self.words = ANSWER
        self.voice: str | None = DEFAULT_VOICE_NAME
        self.llm: ScriptedLlm | None = None
        self.voices: list[str] = []
        self.duplexes: list[FakeDuplex] = []

    async def make(self, kind: str):
        if kind == "duplex":

            def open_duplex(voice, role) -> FakeDuplex:
                self.duplexes.append(FakeDuplex(voice, role))
                return self.duplexes[-1]

            return open_duplex
        self.llm = ScriptedLlm(self.words)

        async def find_voice(name: str):
            if name == "nobody":
                raise SessionError("unknown voice 'nobody'", "session.audio.output.voice")
            self.voices.append(name)
            return name

        def speech(voice) -> FrameSpeech:
            return FrameSpeech(TONE)

        stt = ScriptedStt(True, 0.05)
        return SessionParts(stt, self.llm, speech, find_voice, self.voice, NO_VOICE)


@contextlib.contextmanager
def serving(parts: Parts, api_keys: frozenset[str] = frozenset()):
    """`/v1/realtime` with `parts` on a guarded server in a thread of its own: yields
    host:port."""
    thread = ModelThread("test-realtime")
    thread.start()
    context = ServeContext(thread, EventTally(logging.getLogger("test")), api_keys=api_keys)
    context.model_names = dict(MODELS)
    options = RealtimeOptions(rules=TurnRules(ignore_start=0.0))
    try:
        with served(
            context, with_routes(server.add_routes, context, options, parts.make)
        ) as address:
            yield address
    finally:
        thread.stop()


class Events:
    """A connection's server events (validated dicts) as they come."""

    def __init__(self, connection):
        self.connection = connection
        self.all: list[dict] = []
        self._changed = asyncio.Condition()
        self.failure: BaseException | None = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                data = await self.connection.recv_bytes()
                event = checked(json.loads(data))
                assert self.connection.parse_event(data).type == event["type"]
                async with self._changed:
                    self.all.append(event)
                    self._changed.notify_all()
        except Exception as exc:  # noqa: BLE001 - the test that waits reports it
            self.failure = exc
            async with self._changed:
                self._changed.notify_all()

    async def wait(self, kind: str, after: int = 0, **fields) -> int:
        """The index of the first event of `kind` (with `fields`) from `after` on."""

        def found() -> int | None:
            for i, event in enumerate(self.all[after:], after):
                if event["type"] == kind and all(event.get(k) == v for k, v in fields.items()):
                    return i
            return None

        def ready() -> bool:
            return found() is not None or self.failure is not None

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(ready), WAIT)
        except asyncio.TimeoutError:
            raise AssertionError(f"no {kind} after {after}: {self.kinds()}") from None
        if found() is None:
            raise AssertionError(f"the connection failed: {self.failure!r} after {self.all[-3:]}")
        return found()

    async def event(self, kind: str, after: int = 0, **fields) -> dict:
        """The first event of `kind` (with `fields`) from `after` on, once it came."""
        return self.all[await self.wait(kind, after, **fields)]

    def of(self, kind: str, start: int = 0, end: int | None = None) -> list[dict]:
        """The events of `kind` among `all[start:end]`."""
        return [event for event in self.all[start:end] if event["type"] == kind]

    def kinds(self, start: int = 0, end: int | None = None) -> list[str]:
        return [event["type"] for event in self.all[start:end]]

    def close(self) -> None:
        self._reader.cancel()


@contextlib.asynccontextmanager
async def connected(address: str, model: str = MODELS["llm"], key: str = "sk-test", **query):
    """The `openai` package's realtime connection to `address` and its `Events`, once the
    session is created."""
    client = openai.AsyncOpenAI(api_key=key, base_url=f"http://{address}/v1")
    async with client.realtime.connect(model=model, extra_query=query) as connection:
        events = Events(connection)
        try:
            await events.wait("session.created")
            yield connection, events
        finally:
            events.close()
