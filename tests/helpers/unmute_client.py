"""Unmute's browser, as a test plays it: `/v1/realtime` with the `realtime` subprotocol, a
`session.update`, then a microphone that never stops (Ogg Opus pages of 40 ms, base64, in real
time, as the stock frontend's opus-recorder sends them) and a speaker that decodes the answer.

The conversation: listen to the bot's greeting (Unmute's bot speaks first), say `speech` once
the greeting is done, and listen to the start of the answer. Everything the server sent is kept.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import sphn

SAMPLE_RATE = 24_000
PAGE = 960  # samples per Ogg page the frontend sends (two 20 ms Opus frames)
# Seconds of the answer heard before the test hangs up (a tiny random LLM talks for minutes).
ANSWER_HEARD = 1.0


@dataclass
class BotTurn:
    """One answer of the bot, as the browser saw it."""

    llm_words: list[str] = field(default_factory=list)  # unmute.response.text.delta.ready
    tts_words: list[str] = field(default_factory=list)  # response.text.delta (timed by the TTS)
    text_done: str | None = None  # response.text.done
    audio: list[np.ndarray] = field(default_factory=list)  # decoded response.audio.delta
    chat_history: list[dict] = field(default_factory=list)  # response.created's history
    done: bool = False  # response.audio.done came

    @property
    def pcm(self) -> np.ndarray:
        """The answer's audio, 24 kHz mono float32."""
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


@dataclass
class Conversation:
    """Every event of the session, by type, and the bot's turns in order."""

    event_types: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    transcription: list[str] = field(default_factory=list)
    turns: list[BotTurn] = field(default_factory=list)
    closed: str | None = None  # why the websocket closed, if it did

    def count(self, event_type: str) -> int:
        """How many events of `event_type` came."""
        return self.event_types.count(event_type)


async def converse(
    url: str,
    speech: np.ndarray,
    voice: str,
    instructions: dict,
    timeout: float,
) -> Conversation:
    """Greeting, `speech`, answer over Unmute's `url` (`ws://host:port/v1/realtime`), at most
    `timeout` seconds; the conversation as far as it got."""
    conversation = Conversation()
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, protocols=("realtime",), max_msg_size=0) as ws,
    ):
        update = {"instructions": instructions, "voice": voice, "allow_recording": False}
        await ws.send_str(json.dumps({"type": "session.update", "session": update}))
        listening = asyncio.create_task(_listen(ws, conversation))
        speaking = asyncio.create_task(_microphone(ws, conversation, speech))
        try:
            await asyncio.wait_for(asyncio.shield(listening), timeout)
        except TimeoutError:
            pass
        finally:
            speaking.cancel()
            listening.cancel()
            await asyncio.gather(speaking, listening, return_exceptions=True)
    return conversation


async def _microphone(ws: aiohttp.ClientWebSocketResponse, talk: Conversation, speech: np.ndarray):
    """40 ms pages in real time: silence, `speech` once the first answer is done, silence."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)
    loop = asyncio.get_running_loop()
    start, sent, spoken = loop.time(), 0, 0
    silence = np.zeros(PAGE, np.float32)
    while True:
        if talk.turns and talk.turns[0].done and spoken < speech.size:
            chunk = speech[spoken : spoken + PAGE]
            spoken += chunk.size
            chunk = np.pad(chunk, (0, PAGE - chunk.size))
        else:
            chunk = silence
        page = writer.append_pcm(chunk)
        if page:
            message = {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(page).decode(),
            }
            await ws.send_str(json.dumps(message))
        sent += PAGE
        await asyncio.sleep(max(0.0, start + sent / SAMPLE_RATE - loop.time()))


async def _listen(ws: aiohttp.ClientWebSocketResponse, talk: Conversation) -> None:
    """Server events until `ANSWER_HEARD` seconds of the second answer came (or it was done,
    or the socket closed)."""
    reader = sphn.OpusStreamReader(SAMPLE_RATE)
    async for message in ws:
        if message.type != aiohttp.WSMsgType.TEXT:
            talk.closed = f"{message.type.name} {ws.close_code} {message.extra or ''}"
            return
        event = json.loads(message.data)
        kind = event["type"]
        talk.event_types.append(kind)
        turn = talk.turns[-1] if talk.turns else None
        if kind == "response.created":
            talk.turns.append(BotTurn(chat_history=event["response"]["chat_history"]))
        elif kind == "error":
            talk.errors.append(event["error"])
        elif kind == "conversation.item.input_audio_transcription.delta":
            talk.transcription.append(event["delta"])
        elif turn is None:
            continue
        elif kind == "unmute.response.text.delta.ready":
            turn.llm_words.append(event["delta"])
        elif kind == "response.text.delta":
            turn.tts_words.append(event["delta"])
        elif kind == "response.text.done":
            turn.text_done = event["text"]
        elif kind == "response.audio.delta":
            pcm = reader.append_bytes(base64.b64decode(event["delta"]))
            if pcm.size:
                turn.audio.append(pcm)
            if len(talk.turns) == 2 and turn.pcm.size >= ANSWER_HEARD * SAMPLE_RATE:
                return
        elif kind == "response.audio.done":
            turn.done = True
            if len(talk.turns) == 2:
                return
    talk.closed = f"closed {ws.close_code}"
