"""`/api/tts_streaming`: moshi-server's streaming text-to-speech, on the model thread.

Every stream, websocket or POST, is a row of a batch of `TtsStreams` (one compiled step
per 80 ms frame for all streams of one sampling; see `moshi_mlx.serve.tts.streams`), at most
`context.max_tts_streams` at once.

`GET` upgrades to the websocket of `moshi_mlx.serve.tts.protocol`: a key (header
`kyutai-api-key` or `?auth_id=`), `?format=` (default `PcmMessagePack`), `?voice=` (a voice
of the voice repo, with or without its embedding suffix, e.g.
`unmute-prod-website/p329_022.wav`, or an OpenAI voice name: `serve/openai/voices.py`; or a
cloned voice's id, which `POST /v1/audio/voices` gave: the speech continues that recording;
any other value, a file path too, gets `Error` and a close), `?cfg_alpha=`,
`?temperature=`, `?top_k=`, `?seed=`. `Ready` goes out at once (or `Error "no free
channels"` and a close); the stream starts with the first text (after a `Voice` sent
before it, as Unmute does). `POST` with JSON `{text, voice}` answers a streamed WAV (or 503
when every stream is taken).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import sphn
from aiohttp import web

from moshi_mlx.errors import MoshiError, TtsError, one_line
from moshi_mlx.runtime.sampling import MAX_SEED, Sampling
from moshi_mlx.serve.bodies import BadBody, read_json_object
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.http import origin_allowed
from moshi_mlx.serve.logtext import capped, without_paths
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.serve.openai.voices import VoiceCatalog
from moshi_mlx.serve.sessions import (
    Sessions,
    StoppableConnection,
    close_ended,
    first_to_end,
    live_websocket,
)
from moshi_mlx.serve.tts import protocol
from moshi_mlx.serve.tts.protocol import ProtocolError
from moshi_mlx.serve.tts.session import (
    AudioFrame,
    Failed,
    Finished,
    SessionEvent,
    SessionOptions,
    TtsSession,
)
from moshi_mlx.serve.tts.streams import TtsStreams
from moshi_mlx.tts.stepper import AUDIO_SAMPLING, TEXT_SAMPLING
from moshi_mlx.tts.synthesizer import DEFAULT_CFG_COEF
from moshi_mlx.tts.voices import DEFAULT_VOICE, resolve_voice

TTS_PATH = "/api/tts_streaming"
SAMPLE_RATE = 24_000
# Frames waiting for a client that does not read (40 s of audio); past this it is dropped.
MAX_UNSENT = 500
MAX_POST_CHARS = 64 * 1024  # the text of one POST
MAX_POST_BYTES = 12 * MAX_POST_CHARS + 1024  # its JSON: an escaped character takes 12 bytes
# Seconds a stream may wait for its first text, or for the end of a text that stopped coming.
TEXT_IDLE_SECONDS = 120.0
_DECODE_OFF_LOOP_BYTES = 64 * 1024  # larger messages are decoded on a worker thread
_WEBSOCKET_MAX_BYTES = protocol.MAX_MESSAGE_BYTES

log = logging.getLogger("moshi_mlx.serve.tts")
TTS_STREAMS = web.AppKey("tts_streams", TtsStreams)  # the app's streams, for their counts


def add_routes(app: web.Application, context: ServeContext) -> None:
    """Mount `TTS_PATH` (websocket and POST) for `context.tts`, its streams a real-time job
    of `context.thread`; returns the job."""
    streams = TtsStreams(context.tts, context.max_tts_streams)
    handler = _TtsHandler(context, streams)
    app[TTS_STREAMS] = streams
    app.router.add_get(TTS_PATH, handler.websocket)
    app.router.add_post(TTS_PATH, handler.post)
    app.on_shutdown.append(handler.sessions.close_all)
    app.on_cleanup.append(lambda _app: _removed(context, streams))
    context.thread.add_realtime(streams)
    context.modules.append(
        lambda: {
            "type": "py",
            "path": TTS_PATH,
            "script": "tts.py",
            "used_slots": str(handler.sessions.active),
            "total_slots": str(context.max_tts_streams),
        }
    )
    return streams


async def _removed(context: ServeContext, streams: TtsStreams) -> None:
    context.thread.remove_realtime(streams)


class _TtsHandler:
    def __init__(self, context: ServeContext, streams: TtsStreams):
        self.context = context
        self.streams = streams
        self.sessions = Sessions(context.max_tts_streams, context.tally, log, "speech stream")
        self._catalogs: dict[str, VoiceCatalog] = {}  # by voice repo

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        self.context.check_kyutai_key(request)
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            self.context.tally.count("websockets refused for their origin", request.remote)
            raise web.HTTPForbidden(text="websocket origin is not this server")
        output = request.query.get("format", "PcmMessagePack")
        if output not in protocol.FORMATS:
            raise web.HTTPBadRequest(
                text=f"format {capped(output)} is not one of {', '.join(protocol.FORMATS)}"
            )
        try:
            options, refusal = await self._options(request.query.get("voice"), request.query), None
        except TtsError as exc:  # a voice it does not offer: the protocol's Error, then a close
            options, refusal = None, one_line(exc)
        ws = live_websocket(self.context.limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        encoder = _Encoder(output)

        async def refuse(reason: str = "no free channels") -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                if message := encoder.message(protocol.error(reason)):
                    await ws.send_bytes(message)
            await ws.close()

        if refusal is not None:
            await refuse(refusal)
            return ws
        await self.sessions.run(
            request.remote,
            lambda: _Connection(ws, self.context, self.streams, options, encoder),
            refuse,
        )
        return ws

    async def post(self, request: web.Request) -> web.StreamResponse:
        """JSON `{text, voice}` -> a WAV streamed as it is spoken (16-bit, 24 kHz, mono)."""
        self.context.check_kyutai_key(request)
        try:
            body = await read_json_object(request, MAX_POST_BYTES)
        except BadBody as exc:
            return web.Response(
                status=exc.status, text=f"{exc}; send a JSON object {{text, voice}}"
            )
        text = body.get("text")
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_POST_CHARS:
            raise web.HTTPBadRequest(text='"text" must be a non-empty string (64 k chars at most)')
        voice = body.get("voice")
        try:
            options = await self._options(voice if isinstance(voice, str) else None, request.query)
        except TtsError as exc:  # a voice it does not offer
            raise web.HTTPBadRequest(text=one_line(exc)) from None
        if not await self.sessions.slots.take():
            self.context.tally.count("requests told the server is busy", request.remote)
            raise web.HTTPServiceUnavailable(text="no free channels; try again later")
        try:
            return await self._speak(request, text, options)
        finally:
            await self.sessions.slots.release()

    async def _speak(
        self, request: web.Request, text: str, options: SessionOptions
    ) -> web.StreamResponse:
        events: asyncio.Queue[SessionEvent] = asyncio.Queue()
        session = _session(options, events)
        session.push_text(text)
        session.end()
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        await response.prepare(request)
        await response.write(_wav_header())
        self.streams.start(session)
        self.context.thread.wake()
        try:
            while True:
                event = await events.get()
                if isinstance(event, AudioFrame):
                    pcm = np.clip(event.pcm, -1, 1) * 32767
                    await response.write(pcm.astype("<i2").tobytes())
                elif isinstance(event, Failed | Finished):
                    break
        finally:
            self.streams.stop(session)
            self.context.thread.wake()
        await response.write_eof()
        return response

    async def _options(self, voice: str | None, query) -> SessionOptions:
        """The stream's options of its `voice` (a cloned voice's id, or a voice of the server's
        voice repo: `VoiceCatalog.resolve`; none: the default voice) and its query's sampling;
        `TtsError` (parameter "voice") for a voice the server does not offer, a 400 for a bad
        sampling value, a 503 while the default voice is missing. A model without voice
        embeddings (tts-0.75b-en-public) speaks in cloned voices only: no voice file, and
        `TtsError` naming the upload route for any other voice."""
        model = self.context.tts
        if model.clones_only:
            path, prefix = None, self.context.cloned_voices.clone_prefix(voice)
        else:
            prefix = None
            if voice:
                voice, prefix = self.context.cloned_voices.resolve(voice)
            path = await self._voice_file(voice if prefix is None else None)
        text, audio = TEXT_SAMPLING, AUDIO_SAMPLING
        try:
            if "temperature" in query:  # one temperature for both, as Kyutai's
                temp = _bounded(query["temperature"], 0.0, 2.0)
                text, audio = Sampling(temp, text.top_k), Sampling(temp, audio.top_k)
            if "top_k" in query:
                top_k = int(_bounded(query["top_k"], 1, 10_000))
                text, audio = Sampling(text.temp, top_k), Sampling(audio.temp, top_k)
            config = _bounded(query["cfg_alpha"], 0.0, 10.0) if "cfg_alpha" in query else None
            seed = int(_bounded(query["seed"], 0, MAX_SEED)) if "seed" in query else None
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        cfg_coef = config if config is not None else DEFAULT_CFG_COEF
        return SessionOptions(path, cfg_coef, (text, audio), seed, prefix)

    async def _voice_file(self, voice: str | None) -> Path:
        """The file of `voice` in the server's voice repo (none: the default voice's)."""
        model = self.context.tts
        repo = self.context.voice_repo or model.voice_repo
        if voice:
            catalog = self._catalogs.setdefault(repo, VoiceCatalog(model.config, repo))
            try:
                return await asyncio.to_thread(catalog.resolve, voice)
            except ApiError as exc:
                log.warning("voice refused: %s", capped(exc.message))
                raise TtsError(exc.message, parameter="voice") from None
        try:
            return await asyncio.to_thread(resolve_voice, DEFAULT_VOICE, model.config, repo)
        except MoshiError as exc:
            raise web.HTTPServiceUnavailable(text=without_paths(str(exc))) from None


def _bounded(text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{capped(text)} is not a number") from None
    if not low <= value <= high:
        raise ValueError(f"{capped(text)} is not within [{low:g}, {high:g}]")
    return value


def _session(options: SessionOptions, events: asyncio.Queue) -> TtsSession:
    loop = asyncio.get_running_loop()

    def deliver(event: SessionEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is stopping
            loop.call_soon_threadsafe(events.put_nowait, event)

    return TtsSession(options, deliver)


def _wav_header() -> bytes:
    """A 16-bit mono 24 kHz WAV header of unknown length (sizes 0xFFFFFFFF, as Kyutai's)."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF"
        + struct.pack("<I", unknown)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16)
        + b"data"
        + struct.pack("<I", unknown)
    )


class _Encoder:
    """The output format: which messages go out, and how audio is packed."""

    def __init__(self, output: str):
        self.output = output
        self._opus = sphn.OpusStreamWriter(SAMPLE_RATE) if "OggOpus" in output else None

    def message(self, packed: bytes) -> bytes | None:
        """A protocol message (Ready, Text, Error), or None in the raw formats."""
        return packed if self.output.endswith("MessagePack") else None

    def audio(self, pcm: np.ndarray) -> bytes | None:
        if self._opus is None:
            if self.output == "Pcm":
                return np.asarray(pcm, "<f4").tobytes()
            return protocol.audio(pcm)
        pages = self._opus.append_pcm(np.asarray(pcm, np.float32))
        if not pages:
            return None
        return protocol.ogg_opus(pages) if self.output == "OggOpusMessagePack" else pages


class _Ended(Exception):
    """The stream cannot go on; the reason goes to the client as an Error."""


class _Connection(StoppableConnection):
    """One websocket: text in, audio and word timings out."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        context: ServeContext,
        streams: TtsStreams,
        options: SessionOptions,
        encoder: _Encoder,
    ):
        super().__init__(ws)
        self._context = context
        self._streams = streams
        self._options = options
        self._encoder = encoder
        self._events: asyncio.Queue[SessionEvent] = asyncio.Queue()
        self._session: TtsSession | None = None

    async def run(self) -> str:
        if ready := self._encoder.message(protocol.ready()):
            await self._ws.send_bytes(ready)
        failure = None
        try:
            reason = await first_to_end(self._receive(), self._send())
        except (ProtocolError, _Ended) as exc:
            reason = failure = str(exc)
        except ConnectionError:
            reason = "the client left"
        finally:
            if self._session is not None:
                self._streams.stop(self._session)
                self._context.thread.wake()
        error = protocol.error(without_paths(failure)) if failure is not None else None
        if error is not None and (message := self._encoder.message(error)):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._ws.send_bytes(message)
        await close_ended(self._ws)
        return self._ended(reason)

    def _push(self, text: str | None) -> None:
        """The client's text (None: its end) to its stream, which starts with its first text:
        the text is in before the stream joins a batch, so a batch stepping meanwhile does not
        step it without its first words (padding it would not read alone)."""
        session, starting = self._session, self._session is None
        if session is None:
            session = self._session = _session(self._options, self._events)
        if text is None:
            session.end()
        else:
            session.push_text(text)
        if starting:
            self._streams.start(session)
        self._context.thread.wake()

    async def _receive(self) -> str:
        """Client messages until it leaves (after the end of the text, messages are ignored:
        the audio goes on and `_send` ends the connection)."""
        ended = False
        while True:
            try:
                message = await self._ws.receive(None if ended else TEXT_IDLE_SECONDS)
            except asyncio.TimeoutError:
                raise _Ended(f"no text for {TEXT_IDLE_SECONDS:g} s") from None
            if ended and message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                continue
            if message.type == aiohttp.WSMsgType.TEXT:
                self._push(protocol.text_message(message.data).text)
                continue
            if message.type != aiohttp.WSMsgType.BINARY:
                return "the client left"
            data = message.data
            if len(data) > _DECODE_OFF_LOOP_BYTES:
                parsed = await asyncio.to_thread(protocol.parse, data)
            else:
                parsed = protocol.parse(data)
            if isinstance(parsed, protocol.Voice):
                if self._session is not None:
                    raise ProtocolError("send Voice before the first Text")
                self._options = replace(self._options, voice=parsed.embedding)
            elif isinstance(parsed, protocol.Text):
                self._push(parsed.text)
            else:
                self._push(None)
                ended = True

    async def _send(self) -> str:
        """Audio and words as they come; the connection ends with the audio."""
        while True:
            event = await self._events.get()
            if self._events.qsize() > MAX_UNSENT:
                raise _Ended(f"over {MAX_UNSENT} frames wait for the client; it does not read them")
            if isinstance(event, Finished):
                return "the text was spoken"
            if isinstance(event, Failed):
                raise _Ended(event.reason)
            if isinstance(event, AudioFrame):
                data = self._encoder.audio(event.pcm)
            else:
                data = self._encoder.message(protocol.word(event.text, event.start_s, event.stop_s))
            if data:
                await self._ws.send_bytes(data)
