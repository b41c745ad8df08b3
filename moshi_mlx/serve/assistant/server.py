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
from pathlib import Path

from aiohttp import web

from moshi_mlx.serve.assistant.conversation import (
    AssistantConfig,
    AssistantConnection,
    ConversationParts,
    MakeParts,
)
from moshi_mlx.serve.chat.protocol import refuse
from moshi_mlx.serve.context import API_KEY_HEADER, API_KEY_QUERY, ServeContext
from moshi_mlx.serve.http import origin_allowed
from moshi_mlx.serve.sessions import Sessions, live_websocket
from moshi_mlx.tts.synthesizer import DEFAULT_CFG_COEF
from moshi_mlx.tts.voices import DEFAULT_VOICE

PAGE_PATH = "/assistant/"
SOCKET_PATH = "/api/assistant"
PAGE_DIR = Path(__file__).parent / "static"
# The chat page's files the assistant's page uses as they are.
SHARED_DIR = Path(__file__).parent.parent / "chat" / "static"
SHARED_FILES = ("ogg.js", "voice-link.js", "audio-worklet.js", "style.css")
BUSY = "busy: the assistant is talking with someone else (one conversation at a time)"
_WEBSOCKET_MAX_BYTES = 1 << 20

log = logging.getLogger("moshi_mlx.serve.assistant")


def add_routes(
    app: web.Application,
    context: ServeContext,
    config: AssistantConfig | None = None,
    make_parts: MakeParts | None = None,
) -> None:
    """Mount the page and `SOCKET_PATH` on `app`: conversations with `context`'s STT, TTS
    and LLM (or the parts `make_parts` gives)."""
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


def _parts_maker(context: ServeContext) -> MakeParts:
    """Each conversation's parts: a new STT stream, the server's LLM, TTS streams in the
    default voice. The first conversation opens one TTS stream first, so that a voice the
    voice repo lacks is the client's 0x05 error, not an answer that never comes."""
    voice_checked = False

    def make_speech():
        return context.tts.stream(voice=DEFAULT_VOICE, cfg_coef=DEFAULT_CFG_COEF)

    async def make_parts() -> ConversationParts:
        nonlocal voice_checked
        if not voice_checked:
            await context.thread.call(make_speech)
            voice_checked = True
        stt = await context.thread.call(context.stt.speech_to_text)
        return ConversationParts(stt, context.llm, make_speech)

    return make_parts


async def _to_page(_request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(PAGE_PATH)  # the page's scripts are relative to the folder


def _file_handler(path: Path):
    async def serve_file(_request: web.Request) -> web.StreamResponse:
        return web.FileResponse(path)

    return serve_file


class _AssistantHandler:
    """`SOCKET_PATH`: checks a connection, then runs its conversation if none is running."""

    def __init__(self, context: ServeContext, config: AssistantConfig, make_parts: MakeParts):
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
        ws = live_websocket(self._config.limits, max_msg_size=_WEBSOCKET_MAX_BYTES)
        await ws.prepare(request)
        await self.sessions.run(
            request.remote,
            lambda: AssistantConnection(ws, self._context.thread, self._make_parts, self._config),
            lambda: refuse(ws, BUSY),
        )
        return ws
