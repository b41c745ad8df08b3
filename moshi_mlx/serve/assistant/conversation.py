"""One websocket of `/api/assistant`: one spoken conversation with the LLM (`AssistantConnection`).

The client's Ogg Opus audio is cut into 80 ms frames; each goes through `Assistant.exchange`
and the frame it returns (the answer's audio, or silence) goes back at once, so the answer is
paced by the client's microphone as a speaker would pace it. The assistant's events go out as
`messages.event_message` says. Everything here runs on the event loop; the models run on the
server's one model thread, as the `Assistant`'s jobs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from moshi_mlx.assistant import Assistant, History, ReplySampling, TurnRules
from moshi_mlx.assistant.history import DEFAULT_SYSTEM
from moshi_mlx.assistant.jobs import Listener, SpeechStream
from moshi_mlx.assistant.pipeline import Event, ReplyModel
from moshi_mlx.errors import MoshiError
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.assistant.messages import event_message
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.opus import OpusFrameReader, OpusFrameWriter
from moshi_mlx.serve.chat.protocol import ConversationEnded, Kind, ProtocolError, refuse
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.sessions import (
    BinaryMessages,
    SilenceWatchdog,
    StoppableConnection,
    close_ended,
    first_to_end,
)

# Messages waiting for a client that does not read (a few seconds of audio and words); past
# this the conversation ends.
MAX_UNSENT_MESSAGES = 200


@dataclass(frozen=True)
class ConversationParts:
    """What one conversation runs on: its own STT stream, the LLM, a TTS stream maker (run
    on the model thread)."""

    stt: Listener
    llm: ReplyModel
    make_speech: Callable[[], SpeechStream]


MakeParts = Callable[[], Awaitable[ConversationParts]]


@dataclass(frozen=True)
class AssistantConfig:
    """What every conversation of the server shares."""

    system: str = DEFAULT_SYSTEM
    greeting: bool = True
    rules: TurnRules = field(default_factory=TurnRules)
    sampling: ReplySampling = field(default_factory=ReplySampling)
    limits: Limits = field(default_factory=Limits)
    models: Mapping[str, str] = field(default_factory=dict)  # "stt", "tts", "llm" -> name


class AssistantConnection(StoppableConnection):
    """One websocket's conversation (a `serve.sessions.LiveConnection`)."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        thread: ModelThread,
        make_parts: MakeParts,
        config: AssistantConfig,
    ):
        super().__init__(ws)
        self._thread = thread
        self._make_parts = make_parts
        self._config = config
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._opus_in = OpusFrameReader(SAMPLE_RATE, FRAME_SIZE)
        self._opus_out = OpusFrameWriter(SAMPLE_RATE)
        self._silence = SilenceWatchdog(config.limits.client_silence_timeout)
        self._assistant: Assistant | None = None

    async def run(self) -> str:
        """Converse until the client leaves or something ends it; returns why, for the log."""
        try:
            reason = await self._converse()
        except (MoshiError, ConversationEnded) as exc:  # a ProtocolError, a model's error
            reason = str(exc)
            await refuse(self._ws, reason)
        except ConnectionError:
            reason = "the client left"
        finally:
            if self._assistant is not None:
                await self._assistant.close()
            await close_ended(self._ws)
        return self._ended(reason)

    async def _converse(self) -> str:
        parts = await self._make_parts()
        config = self._config
        self._assistant = Assistant(
            self._thread,
            parts.stt,
            parts.llm,
            parts.make_speech,
            History(config.system),
            rules=config.rules,
            sampling=config.sampling,
            on_event=self._on_event,
        )
        await self._ws.send_bytes(protocol.handshake())
        await self._ws.send_bytes(protocol.metadata(self._metadata()))
        await self._assistant.start(greeting=config.greeting)
        # A ProtocolError or ConversationEnded raised here: the reason goes to the client.
        return await first_to_end(self._receive(), self._send(), self._watch_silence())

    def _metadata(self) -> dict:
        return {
            "server": "moshi_mlx",
            "assistant": True,
            "frame_ms": 1000 * FRAME_SIZE // SAMPLE_RATE,
            "models": dict(self._config.models),
        }

    def _on_event(self, event: Event) -> None:
        message = event_message(event)
        if message is not None:
            self._queue(message)

    def _queue(self, message: bytes) -> None:
        self._outbox.put_nowait(message)

    async def _receive(self) -> str:
        """The client's audio through the assistant, frame by frame; its answer frames out."""
        messages = BinaryMessages(
            self._ws, self._config.limits, ProtocolError, "send binary messages"
        )
        async for data in messages:
            kind, payload = protocol.parse(data)
            if kind != Kind.AUDIO:
                continue  # handshake, ping, control: nothing for us
            self._silence.heard()
            for frame in self._opus_in.feed(payload):
                pages = self._opus_out.encode(self._assistant.exchange(frame))
                if pages:
                    self._queue(protocol.audio(pages))
            if self._outbox.qsize() > MAX_UNSENT_MESSAGES:
                raise ConversationEnded(
                    f"over {MAX_UNSENT_MESSAGES} messages wait for the client; it does not "
                    "read them"
                )
        return messages.ended

    async def _send(self) -> None:
        while True:
            await self._ws.send_bytes(await self._outbox.get())

    async def _watch_silence(self) -> None:
        """End a conversation whose client sends no audio."""
        raise ConversationEnded(await self._silence.ended())
