"""The assistant on `python -m moshi_mlx serve` (mounted when STT, TTS and LLM are all loaded):
its page at `/assistant/` and its websocket `/api/assistant`, one conversation at a time.

A second client is refused with a 0x05 "busy" message: each conversation steps its own STT
and TTS streams in real time on the server's one model thread, and one is what a Mac keeps up
with beside the LLM. The websocket passes the same checks as the server's other routes: the
API key (header or `auth_id` query, as the STT route takes it), the browser's Origin, the
guard's caps and deadlines, and a conversation without client audio for
`client_silence_timeout` ends.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from moshi_mlx.errors import TtsError, one_line
from moshi_mlx.serve.assistant.conversation import (
    AssistantConfig,
    AssistantConnection,
    ConversationParts,
)
from moshi_mlx.serve.chat.protocol import refuse
from moshi_mlx.serve.context import API_KEY_HEADER, API_KEY_QUERY, ServeContext
from moshi_mlx.serve.conversation_voices import ConversationVoices
from moshi_mlx.serve.http import origin_allowed
from moshi_mlx.serve.sessions import Sessions, live_websocket

PAGE_PATH = "/assistant/"
SOCKET_PATH = "/api/assistant"
PAGE_DIR = Path(__file__).parent / "static"
# The chat page's files the assistant's page uses as they are.
SHARED_DIR = Path(__file__).parent.parent / "chat" / "static"
SHARED_FILES = ("ogg.js", "voice-link.js", "audio-worklet.js", "style.css")
NO_VOICE_HINT = f"on this page: open {PAGE_PATH}?voice=ID"
BUSY = "busy: the assistant is talking with someone else (one conversation at a time)"
_WEBSOCKET_MAX_BYTES = 1 << 20
# A conversation's parts in the voice its client names (`?voice=`; None: none named).
VoicedParts = Callable[[str | None], Awaitable[ConversationParts]]

log = logging.getLogger("moshi_mlx.serve.assistant")


def add_routes(
    app: web.Application,
    context: ServeContext,
    config: AssistantConfig | None = None,
    make_parts: VoicedParts | None = None,
) -> None:
    """Mount the page and `SOCKET_PATH` on `app`: conversations with `context`'s STT, TTS
    and LLM (or the parts `make_parts` gives for the voice a client names)."""
    config = config or AssistantConfig(
        limits=context.limits,
        models={role: context.model_names.get(role, "") for role in ("stt", "tts", "llm")},
    )
    handler = _AssistantHandler(context, config, make_parts or _parts_maker(context))
    app.router.add_get(SOCKET_PATH, handler.handle)
    app.on_shutdown.append(handler.sessions.close_all)
    app.router.add_get(PAGE_PATH.rstrip("/"), _to_page)
    app.router.add_get(PAGE_PATH, _file_handler(PAGE_DIR / "index.html"))
    for name in SHARED_FILES:
        app.router.add_get(PAGE_PATH + name, _file_handler(SHARED_DIR / name))
    for path in sorted(PAGE_DIR.iterdir()):
        if path.name != "index.html":
            app.router.add_get(PAGE_PATH + path.name, _file_handler(path))


def _parts_maker(context: ServeContext) -> VoicedParts:
    """Each conversation's parts: a new STT stream, the server's LLM, TTS streams in the
    voice the page names (`?voice=`: a voice of the voice repo or a clone's id, as
    `/v1/realtime` takes one: `ConversationVoices`; none: the default voice). A TTS of cloned
    voices only has no default voice: a conversation needs a clone's id (`CLONED_VOICES_ONLY`,
    and how to name it on the page). A TTS stream is opened before the conversation starts, so
    that a voice the server lacks is the client's 0x05 error, not an answer that never
    comes."""
    voices = ConversationVoices(context)

    async def make_parts(voice: str | None) -> ConversationParts:
        try:
            found = await voices.find(voice)
        except TtsError as exc:
            if not voices.clones_only:
                raise
            raise TtsError(f"{one_line(exc)} ({NO_VOICE_HINT})", parameter="voice") from None
        await context.thread.call(lambda: voices.open(found))
        stt = await context.thread.call(context.stt.speech_to_text)
        return ConversationParts(stt, context.llm, lambda: voices.open(found))

    return make_parts


async def _to_page(_request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(PAGE_PATH)  # the page's scripts are relative to the folder


def _file_handler(path: Path):
    async def serve_file(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(path)

    return serve_file


class _AssistantHandler:
    """`SOCKET_PATH`: checks a connection, then runs its conversation if none is running."""

    def __init__(self, context: ServeContext, config: AssistantConfig, make_parts: VoicedParts):
        self._context = context
        self._config = config
        self._make_parts = make_parts
        self.sessions = Sessions(1, context.tally, log, "conversation")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tally = self._context.tally
        key = request.headers.get(API_KEY_HEADER, request.query.get(API_KEY_QUERY))
        if not self._context.key_allowed(key):
            tally.count("websockets refused for a missing or wrong API key", request.remote)
            raise web.HTTPUnauthorized(text=f"send a valid {API_KEY_HEADER} header")
        origin = request.headers.get("Origin")
        if not origin_allowed(origin, request.host):
            tally.count("websockets refused for their origin", request.remote)
            raise web.HTTPForbidden(text=f"websocket origin {origin} is not this server")
        voice = request.query.get("voice") or None
        ws = live_websocket(self._config.limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        await self.sessions.run(
            request.remote,
            lambda: AssistantConnection(
                ws, self._context.thread, lambda: self._make_parts(voice), self._config
            ),
            lambda: refuse(ws, BUSY),
        )
        return ws
