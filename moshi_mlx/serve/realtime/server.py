"""`/v1/realtime` on `python -m moshi_mlx serve`: OpenAI's Realtime API over the server's
models, mounted when an STT or the chat model (`--moshi`) is loaded.

The handshake is what the `openai` package's `client.realtime.connect(model=...)` sends:
`GET /v1/realtime?model=M` (M a model `GET /v1/models` lists; none: the server's), an
`Authorization: Bearer KEY` header when the server has API keys, no subprotocol;
`?intent=transcription` opens a transcription session (the STT alone); `M` naming the chat
model a full-duplex session with Moshi or PersonaPlex; any other a conversation with the
assistant (the STT, the LLM and the TTS, all loaded). A refused handshake gets OpenAI's JSON
error (401, 400, 404); a session over the cap gets an `error` event and a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from moshi_mlx.assistant import ReplySampling, TurnRules
from moshi_mlx.errors import TtsError, one_line
from moshi_mlx.realtime import (
    DUPLEX,
    REALTIME,
    TRANSCRIPTION,
    RealtimeSession,
    SessionConfig,
    SessionError,
    SessionParts,
)
from moshi_mlx.realtime.duplex import DuplexRealtimeSession, OpenDuplex
from moshi_mlx.realtime.events import error
from moshi_mlx.serve.chat.persona import prompt_choice
from moshi_mlx.serve.chat.protocol import ProtocolError
from moshi_mlx.serve.cloned_voices import CLONED_VOICES_ONLY
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.conversation_voices import ConversationVoices
from moshi_mlx.serve.guard import CLOSE_SECONDS
from moshi_mlx.serve.openai.errors import ApiError, answers_api_errors, check_bearer_key
from moshi_mlx.serve.realtime.connection import MAX_MESSAGE_BYTES, RealtimeConnection
from moshi_mlx.serve.sessions import Sessions, close_ended, live_websocket

PATH = "/v1/realtime"
# Conversations at once (each steps its STT and TTS in real time on the one model thread)
# and transcription sessions at once.
MAX_CONVERSATIONS = 1
MAX_TRANSCRIPTIONS = 4

log = logging.getLogger("moshi_mlx.serve.realtime")

# A session kind -> its parts (DUPLEX: a function opening a full-duplex conversation).
MakeParts = Callable[[str], Awaitable[SessionParts | OpenDuplex]]


@dataclass(frozen=True)
class RealtimeOptions:
    """What every session of the route shares: the turn-taking and the LLM's sampling."""

    rules: TurnRules = field(default_factory=TurnRules)
    sampling: ReplySampling = field(default_factory=ReplySampling)


def add_routes(
    app: web.Application,
    context: ServeContext,
    options: RealtimeOptions | None = None,
    make_parts: MakeParts | None = None,
) -> None:
    """Mount `PATH` on `app`: sessions on `context`'s models (or the parts `make_parts`
    gives for a session kind)."""
    handler = _RealtimeHandler(context, options or RealtimeOptions(), make_parts)
    app.router.add_get(PATH, answers_api_errors(handler.handle))
    app.on_shutdown.append(handler.close_all)


def _parts_maker(context: ServeContext) -> MakeParts:
    """A new STT stream per session; for a conversation the server's LLM and TTS streams in
    a voice of the server's voice repo (OpenAI's voice names: the default voice) or a voice
    cloned by `POST /v1/audio/voices` (its id), as `ConversationVoices` finds them. A TTS of
    cloned voices only (no voice embeddings: tts-0.75b-en-public) takes a clone's id only: a
    session starts with no voice, and any other is refused (`CLONED_VOICES_ONLY`), as the TTS
    routes refuse it."""
    voices = None if context.tts is None else ConversationVoices(context)

    async def find_voice(name: str):
        try:
            return await voices.find(name)
        except TtsError as exc:
            param, code = "session.audio.output.voice", "voice_not_found"
            raise SessionError(one_line(exc), param, code) from None

    async def make_parts(kind: str) -> SessionParts | OpenDuplex:
        if kind == DUPLEX:
            return _duplex_opener(context)
        stt = await context.thread.call(context.stt.speech_to_text)
        if kind == TRANSCRIPTION:
            return SessionParts(stt)
        if voices.clones_only:
            voice, no_voice = None, CLONED_VOICES_ONLY
            return SessionParts(stt, context.llm, voices.open, find_voice, voice, no_voice)
        return SessionParts(stt, context.llm, voices.open, find_voice)

    return make_parts


def _duplex_opener(context: ServeContext) -> OpenDuplex:
    """Conversations of the server's chat model (Moshi, PersonaPlex) with its sampling, in a
    session's persona (None: the server's); SessionError while it loads or if it failed."""
    chat = context.chat
    if not chat.ready.is_set():
        raise SessionError("the chat model is still loading; try again shortly", "model")
    if chat.error is not None:
        raise SessionError(f"the chat model failed to load: {one_line(chat.error)}", "model")
    settings = chat.settings

    def open_duplex(voice: str | None, role: str | None):
        if not chat.persona.prompted:  # Moshi: no persona (a client's instructions aside)
            voice = role = None
        voice = _persona_choice("voice_prompt", voice, chat, "session.audio.output.voice")
        role = _persona_choice("text_prompt", role, chat, "session.instructions")
        return chat.session(settings.sampling, settings.seed, voice, role)

    return open_duplex


def _persona_choice(name: str, value: str | None, chat, param: str) -> str | None:
    """A PersonaPlex voice or role as `/api/chat` checks it (a published voice name, a role
    of bounded length); SessionError naming `param` otherwise."""
    if value is None:
        return None
    try:
        voice, role = prompt_choice({name: value}, chat.persona)
    except ProtocolError as exc:
        message = str(exc).replace(f"query parameter {name}", param)
        raise SessionError(message, param) from None
    return voice if name == "voice_prompt" else role


class _RealtimeHandler:
    def __init__(self, context: ServeContext, options: RealtimeOptions, make_parts):
        self._context = context
        self._options = options
        self._converses = make_parts is not None or (
            context.llm is not None and context.tts is not None
        )
        self._transcribes = make_parts is not None or context.stt is not None
        self._make_parts = make_parts or _parts_maker(context)
        self._sessions = {
            REALTIME: Sessions(MAX_CONVERSATIONS, context.tally, log, "realtime session"),
            TRANSCRIPTION: Sessions(MAX_TRANSCRIPTIONS, context.tally, log, "transcription"),
            DUPLEX: Sessions(MAX_CONVERSATIONS, context.tally, log, "realtime Moshi session"),
        }

    async def close_all(self, app: web.Application) -> None:
        for sessions in self._sessions.values():
            await sessions.close_all(app)

    def _kind_and_model(self, request: web.Request) -> tuple[str, str]:
        """The session's kind (transcription with the intent; Moshi when `model` names it, or
        names nothing on a server without the assistant; else the assistant) and model."""
        context = self._context
        names = context.model_names
        model = request.query.get("model") or ""
        moshi = names.get("moshi") or ("moshi" if context.chat is not None else None)
        if model and model != moshi and not any(context.is_model(k, model) for k in names):
            served = ", ".join(sorted(set(names.values()))) or "none"
            raise ApiError(
                404, f"model {model[:100]!r} is not served here (GET /v1/models: {served})",
                "model", "model_not_found",
            )  # fmt: skip
        if request.query.get("intent") == "transcription":
            if not self._transcribes:
                raise ApiError(400, "this server has no STT to transcribe with (--stt)", "intent")
            kind = TRANSCRIPTION
        elif moshi is not None and (
            model == moshi or context.is_model("moshi", model) or not (model or self._converses)
        ):
            kind = DUPLEX
        elif self._converses:
            kind = REALTIME
        else:
            raise ApiError(
                400,
                "this server has no conversation to offer (--stt --tts --llm, or --moshi): "
                "connect with ?intent=transcription",
                "intent",
            )
        default = {TRANSCRIPTION: names.get("stt"), DUPLEX: moshi}.get(kind, names.get("llm"))
        return kind, model or default or ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        check_bearer_key(request, self._context.key_allowed)
        kind, model = self._kind_and_model(request)
        ws = live_websocket(self._context.limits, max_msg_size=MAX_MESSAGE_BYTES)
        await ws.prepare(request)
        options = self._options

        async def make_session(emit) -> RealtimeSession | DuplexRealtimeSession:
            parts = await self._make_parts(kind)
            if kind == DUPLEX:
                return DuplexRealtimeSession(parts, SessionConfig(model=model), emit)
            config = SessionConfig(kind=kind, model=model, voice=parts.voice)
            thread = self._context.thread
            return RealtimeSession(thread, parts, config, emit, options.rules, options.sampling)

        async def refuse() -> None:
            busy = error(
                "the server runs as many sessions of this kind as it can at once; try later",
                None, "session_limit", "server_error",
            )  # fmt: skip
            with contextlib.suppress(ConnectionError, RuntimeError, asyncio.TimeoutError):
                await asyncio.wait_for(ws.send_str(json.dumps(busy)), CLOSE_SECONDS)
            await close_ended(ws)

        await self._sessions[kind].run(
            request.remote,
            lambda: RealtimeConnection(ws, make_session, self._context.limits),
            refuse,
        )
        return ws
