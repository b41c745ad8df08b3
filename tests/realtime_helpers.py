"""Helpers of the `/v1/realtime` tests: a guarded server with scripted parts (an STT that hears
a word in every loud frame and whose pause head says "done" on quiet ones, an LLM that streams
given words, a TTS that plays three frames of a tone per word), audio in the protocol's
format, and each server event checked against the `openai` package's types."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
import typing

import numpy as np
from aiohttp import web
from assistant_fakes import FrameSpeech, ScriptedStt
from openai.types.realtime.realtime_server_event import RealtimeServerEvent

from moshi_mlx.assistant import TurnRules
from moshi_mlx.llm import TextPiece
from moshi_mlx.realtime import SessionError, SessionParts
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.realtime import server
from moshi_mlx.serve.realtime.server import RealtimeOptions

_TIME = np.arange(FRAME_SIZE) / SAMPLE_RATE
LOUD = (0.3 * np.sin(2 * np.pi * 440 * _TIME)).astype(np.float32)
QUIET = np.zeros(FRAME_SIZE, np.float32)
TONE = (0.5 * np.sin(2 * np.pi * 330 * _TIME)).astype(np.float32)
ANSWER = ["Paris", "is", "**lovely**."]
LONG_ANSWER = [f"word{i}" for i in range(40)]
MODELS = {"llm": "scripted-llm", "stt": "scripted-stt", "tts": "scripted-tts"}

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


class Parts:
    """The scripted parts of each session; `llm` is the last session's LLM."""

    def __init__(self):
        self.words = ANSWER
        self.llm: ScriptedLlm | None = None
        self.voices: list[str] = []

    async def make(self, kind: str) -> SessionParts:
        self.llm = ScriptedLlm(self.words)

        async def find_voice(name: str):
            if name == "nobody":
                raise SessionError("unknown voice 'nobody'", "session.audio.output.voice")
            self.voices.append(name)
            return name

        return SessionParts(
            ScriptedStt(True, 0.05), self.llm, lambda voice: FrameSpeech(TONE), find_voice
        )


@contextlib.contextmanager
def serving(parts: Parts, api_keys: frozenset[str] = frozenset()):
    """`/v1/realtime` with `parts` on a guarded server in a thread of its own: yields
    host:port."""
    thread = ModelThread("test-realtime")
    thread.start()
    context = ServeContext(thread, EventTally(logging.getLogger("test")), api_keys=api_keys)
    context.model_names = dict(MODELS)
    options = RealtimeOptions(rules=TurnRules(ignore_start=0.0))
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()

    async def start():
        guard = ConnectionGuard(context.limits, context.tally)
        app = web.Application(middlewares=[guard.middleware])
        server.add_routes(app, context, options, parts.make)
        runner = guard.app_runner(app, access_log=None)
        await runner.setup()
        await guard.site(runner, "127.0.0.1", 0).start()
        return runner

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        thread.stop()
