"""`/api/asr-streaming`: Kyutai's streaming speech-to-text websocket (`stt.protocol`), one
stream per connection, every stream a row of one batch stepped once per frame.

Everything here runs on the asyncio event loop and never touches MLX: client audio goes to
the `SttWorker` (a real-time job of the model thread; its pacing is in its module) through
each connection's `Channel`, and the worker's results come back through an `asyncio.Queue` per connection, so a client
that stops reading stalls only its own connection. Caps, deadlines and liveness checks come
from `moshi_mlx.serve.guard`.

As Kyutai's server does, `Ready` goes out as soon as the server is warm (the stream is made
on the model thread meanwhile; audio waits for it), and audio that waits because the model
is behind is kept and stepped to catch up. Only a client that sends audio faster than real
time, by over `max_buffered_seconds`, is told so and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiohttp import web

from moshi_mlx.serve.bodies import ProtocolError
from moshi_mlx.serve.context import API_KEY_HEADER, API_KEY_QUERY, ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.http import origin_allowed
from moshi_mlx.serve.limits import Limits
from moshi_mlx.serve.logtext import without_paths
from moshi_mlx.serve.sessions import (
    BinaryMessages,
    Sessions,
    SilenceWatchdog,
    StoppableConnection,
    close_ended,
    first_to_end,
    live_websocket,
    send_and_close,
)
from moshi_mlx.serve.stt import protocol
from moshi_mlx.serve.stt.worker import (
    Channel,
    MarkerReached,
    Opened,
    Stepped,
    StreamFailed,
    SttWorker,
)
from moshi_mlx.stt.batch import SttBatch
from moshi_mlx.stt.events import WordEnded, WordStarted

ASR_PATH = "/api/asr-streaming"
# Messages waiting for a client that does not read; past this it is dropped.
MAX_UNSENT_MESSAGES = 1000
# Larger messages are refused by the websocket layer itself (close code 1009); between
# protocol.MAX_MESSAGE_BYTES and this the client gets an Error with the reason.
_WEBSOCKET_MAX_BYTES = 2 * protocol.MAX_MESSAGE_BYTES

log = logging.getLogger("moshi_mlx.stt")
STT_WORKER = web.AppKey("stt_worker", SttWorker)  # the app's worker, for its counts


@dataclass(frozen=True)
class SttServerConfig:
    """What the server's flags decide for every connection."""

    max_streams: int = 8
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    # Seconds of client audio that may wait for the model before the client is dropped.
    max_buffered_seconds: float = 60.0
    loopback_only: bool = False  # bound to loopback: answer only for loopback host names
    limits: Limits = field(default_factory=Limits)


def add_routes(app: web.Application, context: ServeContext) -> SttWorker:
    """Mount `ASR_PATH` on `app` for `context.stt` (or its `stt_rows`), its streams rows of
    one batch of `context.max_streams`, a real-time job of `context.thread` (started here: the
    model is loaded; the batch's step compiles before the first Ready); returns the worker."""
    model = context.stt
    config = SttServerConfig(
        max_streams=context.max_streams,
        api_keys=context.api_keys,
        max_buffered_seconds=context.max_buffered_seconds,
        loopback_only=context.loopback_only,
        limits=context.limits,
    )
    rows = context.stt_rows or (lambda count: SttBatch(model, count, context.stt_sampling))
    worker = SttWorker(rows, config.max_streams, context.thread)
    handler = _SttHandler(worker, config, context.tally)
    app[STT_WORKER] = worker
    app.router.add_get(ASR_PATH, handler.handle)
    app.on_shutdown.append(handler.sessions.close_all)
    app.on_cleanup.append(lambda _app: _stopped(worker))
    worker.start()
    context.modules.append(
        lambda: {
            "type": "batched_asr",
            "path": ASR_PATH,
            "lm": context.model_names.get("stt", ""),
            "used_slots": str(handler.sessions.active),
            "total_slots": str(config.max_streams),
        }
    )
    return worker


async def _stopped(worker: SttWorker) -> None:
    worker.stop()


def api_key_allowed(key: str | None, api_keys: frozenset[str]) -> bool:
    """Kyutai's rule: the key must be one of `api_keys`; with none configured, all pass.
    A key that is not UTF-8 text never matches."""
    return ServeContext.key_matches(key, api_keys)


class _SttHandler:
    """`ASR_PATH`: checks a connection, then runs its stream within `max_streams`."""

    def __init__(self, worker: SttWorker, config: SttServerConfig, tally: EventTally):
        self._worker = worker
        self._config = config
        self._tally = tally
        self.sessions = Sessions(config.max_streams, tally, log, "stream")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get(API_KEY_HEADER, request.query.get(API_KEY_QUERY))
        if not api_key_allowed(key, self._config.api_keys):
            self._tally.count("websockets refused for a missing or wrong API key", request.remote)
            raise web.HTTPUnauthorized(text=f"send a valid {API_KEY_HEADER} header")
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            self._tally.count("websockets refused for their origin", request.remote)
            raise web.HTTPForbidden(text=f"websocket origin {origin} is not this server")
        ws = live_websocket(self._config.limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        busy = f"busy: all {self._config.max_streams} streams are in use; try again later"
        await self.sessions.run(
            request.remote,
            lambda: _SttConnection(ws, self._worker, self._config),
            lambda: _fail(ws, busy),
        )
        return ws


class _StreamEnded(Exception):
    """The server cannot go on with a stream; the reason goes to the client as an Error."""


async def _fail(ws: web.WebSocketResponse, reason: str) -> None:
    """Send the protocol's error with the reason, and close."""
    await send_and_close(ws, protocol.error(without_paths(reason)))


class _SttConnection(StoppableConnection):
    """One websocket: the client's audio and markers to the worker, its results back."""

    def __init__(self, ws: web.WebSocketResponse, worker: SttWorker, config: SttServerConfig):
        super().__init__(ws)
        self._worker = worker
        self._config = config
        self._unsent: asyncio.Queue[bytes | StreamFailed] = asyncio.Queue()
        self._channel: Channel | None = None
        self._streaming = asyncio.Event()
        self._stalled = asyncio.Event()
        self._silence = SilenceWatchdog(config.limits.client_silence_timeout)
        self._started = time.monotonic()

    async def run(self) -> str:
        """Transcribe until the client leaves or something ends it; returns why, for the log."""
        loop = asyncio.get_running_loop()
        self._channel = Channel(lambda event: loop.call_soon_threadsafe(self._on_event, event))
        failure = None
        try:  # nothing else goes out after an Error: the other tasks are cancelled
            reason = await first_to_end(
                self._receive(), self._send(), self._watch_silence(), self._watch_stall()
            )
        except (ProtocolError, _StreamEnded) as exc:
            reason = failure = str(exc)
        except ConnectionError:
            reason = "the client left"
        finally:
            self._worker.release(self._channel)
        if failure is not None:
            await _fail(self._ws, failure)
        else:
            await close_ended(self._ws)
        reason = self._ended(reason)
        if silent := self._channel.silent_steps:
            reason += f" ({silent} steps heard silence: its audio came late)"
        return reason

    def _on_event(self, event: Opened | Stepped | MarkerReached | StreamFailed) -> None:
        """A worker result, on the loop: queued for the client as protocol messages."""
        if isinstance(event, StreamFailed):
            self._unsent.put_nowait(event)
            return
        if isinstance(event, Opened):
            return  # Ready went out already
        if isinstance(event, Stepped):
            self._silence.heard()  # audio still being transcribed: the client is not idle
            messages = _step_messages(event)
        else:
            messages = [protocol.marker(event.id)]
        for message in messages:
            self._unsent.put_nowait(message)
        if self._unsent.qsize() > MAX_UNSENT_MESSAGES:
            self._stalled.set()

    async def _receive(self) -> str:
        """Client messages until it leaves; audio before Ready waits for the stream."""
        messages = BinaryMessages(
            self._ws, self._config.limits, ProtocolError, "send binary msgpack messages"
        )
        async for data in messages:
            parsed = protocol.parse(data)
            if isinstance(parsed, protocol.Audio):
                self._silence.heard()
                self._channel.push_audio(parsed.pcm)
                if self._ahead_of_real_time() > self._config.max_buffered_seconds:
                    raise _StreamEnded(
                        f"over {self._config.max_buffered_seconds:g} s of audio wait to be "
                        "transcribed; send audio no faster than real time"
                    )
                self._worker.notify()
            elif isinstance(parsed, protocol.Marker):
                self._channel.push_marker(parsed.id)
                self._worker.notify()
        return messages.ended

    def _ahead_of_real_time(self) -> float:
        """Seconds of audio the client sent beyond the time since it connected."""
        sent = self._channel.received / protocol.SAMPLE_RATE
        return sent - (time.monotonic() - self._started)

    async def _send(self) -> None:
        """Once the worker is ready: Ready, the stream opened, then its results as they come."""
        while not self._worker.ready.is_set():  # warming up: the websocket layer pings
            await asyncio.sleep(0.1)
        if self._worker.error is not None:
            raise _StreamEnded("the server could not load the model")
        self._worker.open(self._channel)
        await self._ws.send_bytes(protocol.ready())
        self._streaming.set()
        while True:
            message = await self._unsent.get()
            if isinstance(message, StreamFailed):
                raise _StreamEnded(message.reason)
            await self._ws.send_bytes(message)

    async def _watch_silence(self) -> None:
        """End a stream whose client sends no audio while nothing is left to transcribe."""
        await self._streaming.wait()
        raise _StreamEnded(await self._silence.ended())

    async def _watch_stall(self) -> None:
        await self._stalled.wait()
        raise _StreamEnded(
            f"over {MAX_UNSENT_MESSAGES} messages wait for the client; it does not read them"
        )


def _step_messages(event: Stepped) -> list[bytes]:
    """A step as Kyutai's server sends it: Step (only when the model has pause heads; its
    `step_idx` counts the steps taken, this one included), then its words."""
    step = event.step
    messages = []
    if step.pause_probabilities:
        messages.append(protocol.step(step.index + 1, step.pause_probabilities, event.buffered_pcm))
    for item in step.events:
        if isinstance(item, WordStarted):
            messages.append(protocol.word(item.text, item.start))
        elif isinstance(item, WordEnded):
            messages.append(protocol.end_word(item.end))
        # EndOfTurn has no message: clients judge turns from Step's probabilities.
    return messages
