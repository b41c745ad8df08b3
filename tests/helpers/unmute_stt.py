"""A scripted speech-to-text server for Unmute's turn-taking (`/api/asr-streaming`, moshi-server's
protocol as our `moshi_mlx.serve.stt.protocol` packs it).

A tiny random STT model hears no words and predicts no end of turn, so this stands in for the STT
(issue 31 allows it; the TTS and the LLM stay ours). It hears, not guesses: each 80 ms frame of
client audio louder than `SPEECH_RMS` is speech. While the client speaks, it says the scripted
transcript one `Word` every `FRAMES_PER_WORD` frames and reports a pause probability of 0; once
`PAUSE_FRAMES` quiet frames follow speech, it says any words left, an `EndWord`, and reports 1.
Silence before any speech reports 1 too (the user is listening: no interruption of the bot).
Unmute reads `prs[2]`, so every `Step` carries `HEADS` probabilities, as Kyutai's STT does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from aiohttp import WSMsgType, web

from moshi_mlx.serve.stt import protocol

FRAME = 1920  # samples per 80 ms step at 24 kHz
STEP_SECONDS = FRAME / protocol.SAMPLE_RATE
SPEECH_RMS = 0.01
FRAMES_PER_WORD = 3
PAUSE_FRAMES = 4
HEADS = 4
ASR_PATH = "/api/asr-streaming"


@dataclass
class SttLog:
    """What the server saw, for the test to check: per connection, samples heard and words said."""

    api_keys: list[str | None] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    words: list[list[str]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


class ScriptedTurns:
    """One connection's state: turns `pcm` frames into protocol messages."""

    def __init__(self, transcript: list[str]):
        self._words = list(transcript)
        self._pending = np.zeros(0, np.float32)
        self._step = 0
        self._speech_frames = 0
        self._quiet_frames = 0
        self._in_turn = False
        self.said: list[str] = []

    @property
    def steps(self) -> int:
        """Steps reported so far."""
        return self._step

    def feed(self, pcm: np.ndarray) -> list[bytes]:
        """The messages that `pcm` (any length) completes: a Step per full frame, and words."""
        self._pending = np.concatenate([self._pending, pcm])
        messages = []
        while self._pending.size >= FRAME:
            frame, self._pending = self._pending[:FRAME], self._pending[FRAME:]
            messages += self._frame(frame)
        return messages

    def _frame(self, frame: np.ndarray) -> list[bytes]:
        now = self._step * STEP_SECONDS
        messages = []
        if float(np.sqrt(np.mean(frame**2))) > SPEECH_RMS:
            self._in_turn, self._quiet_frames = True, 0
            if self._speech_frames % FRAMES_PER_WORD == 0 and self._words:
                messages.append(self._word(now))
            self._speech_frames += 1
        elif self._in_turn:
            self._quiet_frames += 1
            if self._quiet_frames == PAUSE_FRAMES:
                while self._words:
                    messages.append(self._word(now))
                messages.append(protocol.end_word(now))
                self._in_turn = False
        pause = 0.0 if self._in_turn else 1.0
        self._step += 1
        messages.append(protocol.step(self._step, [pause] * HEADS, int(self._pending.size)))
        return messages

    def _word(self, start_time: float) -> bytes:
        text = self._words.pop(0)
        self.said.append(text)
        return protocol.word(text, start_time)


def scripted_stt_app(transcript: list[str], log: SttLog) -> web.Application:
    """The aiohttp app: `ASR_PATH` speaking `transcript`, and `/api/build_info` for health."""

    async def build_info(_request: web.Request) -> web.Response:
        return web.json_response({"build": "scripted stt (tests/helpers/unmute_stt.py)"})

    async def asr(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=protocol.MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        turns = ScriptedTurns(transcript)
        index = len(log.samples)
        log.api_keys.append(request.headers.get("kyutai-api-key"))
        log.samples.append(0)
        log.words.append(turns.said)
        log.steps.append(0)
        await ws.send_bytes(protocol.ready())
        async for message in ws:
            if message.type != WSMsgType.BINARY:
                break
            parsed = protocol.parse(message.data)
            if not isinstance(parsed, protocol.Audio):
                continue
            log.samples[index] += parsed.pcm.size
            for reply in turns.feed(parsed.pcm):
                await ws.send_bytes(reply)
            log.steps[index] = turns.steps
        return ws

    app = web.Application()
    app.router.add_get("/api/build_info", build_info)
    app.router.add_get(ASR_PATH, asr)
    return app


async def start_scripted_stt(
    transcript: list[str], log: SttLog, host: str = "127.0.0.1"
) -> tuple[web.AppRunner, int]:
    """Serve `scripted_stt_app` on a free loopback port: (runner to clean up, port)."""
    runner = web.AppRunner(scripted_stt_app(transcript, log))
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, port
