"""The aiohttp application of `python -m moshi_mlx serve`: Kyutai's `/api/build_info` and
`/api/modules_info`, and the routes of every loaded model's protocol families.

A family is a module with `add_routes(app, context)` (`moshi_mlx.serve.context`); each is
mounted when the model it serves is loaded; OpenAI's `/v1/models` whenever any model is; the
assistant's page (`/assistant/`) when the STT, the TTS and the LLM all are.
"""

from __future__ import annotations

import functools
import platform
import sys
from importlib import metadata

from aiohttp import web

from moshi_mlx.serve.assistant import server as assistant_routes
from moshi_mlx.serve.chat import server as chat_routes
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import ConnectionGuard
from moshi_mlx.serve.http import loopback_only
from moshi_mlx.serve.openai import audio as openai_audio
from moshi_mlx.serve.openai import chat as openai_chat
from moshi_mlx.serve.openai.errors import add_fallback_route
from moshi_mlx.serve.realtime import server as realtime_routes
from moshi_mlx.serve.stt import server as stt_routes
from moshi_mlx.serve.tts import server as tts_routes

BUILD_INFO_PATH = "/api/build_info"
MODULES_INFO_PATH = "/api/modules_info"


def create_app(context: ServeContext, guard: ConnectionGuard) -> web.Application:
    """The application for `context`'s loaded models, served through `guard`."""
    middlewares = [guard.middleware]
    if context.loopback_only:
        middlewares.append(loopback_only(guard.tally))
    app = web.Application(middlewares=middlewares)
    app.router.add_get(BUILD_INFO_PATH, _build_info)
    app.router.add_get(MODULES_INFO_PATH, functools.partial(_modules_info, context))
    if context.stt is not None or context.stt_rows is not None:
        stt_routes.add_routes(app, context)
    if context.tts is not None:
        tts_routes.add_routes(app, context)
    if context.stt is not None or context.tts is not None:
        openai_audio.add_routes(app, context)
    openai_chat.add_routes(app, context)  # /v1/models for every model; completions with an LLM
    if context.stt is not None and context.tts is not None and context.llm is not None:
        assistant_routes.add_routes(app, context)  # the spoken assistant's page and websocket
    if context.stt is not None or context.chat is not None:
        realtime_routes.add_routes(app, context)  # OpenAI's /v1/realtime: the assistant,
        # transcription with the STT alone, Moshi full duplex
    add_fallback_route(app, context.key_allowed)  # any other /v1 route: OpenAI's error shape
    if context.chat is not None:
        chat_routes.add_routes(app, context)  # last: its page's files answer under `/`
    return app


def build_info() -> dict[str, str]:
    """Kyutai's build_info fields, with what describes this server."""
    try:
        version = metadata.version("moshi_mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "build_timestamp": "",
        "build_date": "",
        "git_branch": "",
        "git_timestamp": "",
        "git_date": "",
        "git_hash": "",
        "git_describe": f"moshi_mlx {version}",
        "rustc_host_triple": f"{platform.machine()}-{sys.platform}",
        "rustc_version": f"python {platform.python_version()}",
        "cargo_target_triple": f"{platform.machine()}-{sys.platform}",
    }


async def _build_info(_request: web.Request) -> web.Response:
    return web.json_response(build_info())


async def _modules_info(context: ServeContext, request: web.Request) -> web.Response:
    context.check_kyutai_key(request)
    return web.json_response([module() for module in context.modules])
