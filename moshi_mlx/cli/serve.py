"""`python -m moshi_mlx serve`: one process, one port, one MLX thread, serving any combination
of Moshi/PersonaPlex/Hibiki (Kyutai's chat protocol and our page), Kyutai's STT and TTS
(moshi-server's protocols) and an mlx-lm LLM (OpenAI's).

`web` and `stt --serve` are presets of this command (`Preset`): the same flags, guard and
limits, with other defaults, which their `--help` names.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import sys
import textwrap
import threading
import webbrowser
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlencode

from moshi_mlx.checkpoints.spec import (
    DEFAULT_REPO,
    DEFAULT_STT_REPO,
    DEFAULT_TTS_REPO,
    DEFAULT_VOICE_REPO,
)
from moshi_mlx.cli.chat_flags import (
    add_model_args,
    add_persona_args,
    check_persona_args,
    load_model,
    print_memory_plan,
    print_voice_names,
    sampling_from_args,
)
from moshi_mlx.cli.common import (
    CliParser,
    add_alias,
    add_limit_args,
    add_max_lag_arg,
    file_options,
    invoked_as,
    limits_from_args,
    max_lag_frames,
    port,
    positive_float,
    positive_int,
    run_cli,
)
from moshi_mlx.errors import ConfigError
from moshi_mlx.llm import DEFAULT_MAX_TOKENS, LlmModel
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.runtime.sampling import GREEDY, Sampling
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.assistant.server import PAGE_PATH as ASSISTANT_PAGE
from moshi_mlx.serve.chat.service import PAGE_DIR, ChatService, ChatSettings
from moshi_mlx.serve.cloned_voices import CLONED_VOICES_ONLY
from moshi_mlx.serve.context import API_KEY_QUERY, ServeContext
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.http import is_loopback
from moshi_mlx.serve.limits import fitted_limits
from moshi_mlx.serve.memory import memory_plan_line
from moshi_mlx.serve.sessions import stop_on_sigterm
from moshi_mlx.serve.stt.server import SttServerConfig
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.tts.synthesizer import TtsModel
from moshi_mlx.tts.voices import default_voice_status

# Unmute's defaults are three ports (STT 8090, TTS 8089, LLM 8091); one server serves all
# three on Unmute's STT port, and Unmute is pointed at it with its KYUTAI_*_URL variables.
DEFAULT_PORT = 8090
# A client of moshi-server's protocols may send nothing for long stretches (a TTS client
# listening to a long answer): it is pinged after half of this, and dropped without a pong
# within a quarter.
SILENCE_TIMEOUT_SECONDS = 30.0
# Unmute against this server; the README gives the same commands.
UNMUTE_COMMANDS = """\
    python -m moshi_mlx serve --stt --tts --llm mlx-community/Llama-3.2-3B-Instruct-4bit
    KYUTAI_STT_URL=ws://127.0.0.1:8090 KYUTAI_TTS_URL=ws://127.0.0.1:8090 \\
    KYUTAI_LLM_URL=http://127.0.0.1:8090 KYUTAI_LLM_MODEL=mlx-community/Llama-3.2-3B-Instruct-4bit \\
      uv run uvicorn unmute.main_websocket:app --host 127.0.0.1 --port 8000 --ws-per-message-deflate=false
"""
UNMUTE_HELP = (
    'Unmute against this server (Unmute sends the key "public_token": use no --api-key, '
    "or that one):\n" + UNMUTE_COMMANDS
)

log = logging.getLogger("moshi_mlx.serve")


@dataclass(frozen=True)
class Preset:
    """A command that is `serve` with other defaults (`defaults`: flag dest -> value).
    `weights_of` is the model the weight flags (`--hf-repo`, `--moshi-weight`, ...) load."""

    command: str
    description: str
    defaults: Mapping[str, object] = field(default_factory=dict)
    weights_of: str = "moshi"
    epilog: str = ""


SERVE = Preset(
    "serve",
    "Serve Moshi/PersonaPlex/Hibiki (Kyutai's chat protocol, /api/chat, and a page at /), "
    "Kyutai's STT and TTS (moshi-server's /api/asr-streaming, /api/tts_streaming) and an "
    "mlx-lm LLM (OpenAI's /v1) on one port, on one model thread.",
    epilog=UNMUTE_HELP,
)
WEB = Preset(
    "web",
    "Talk with Moshi in a browser: `serve --moshi` with the defaults of a page for one person "
    "(port 8998, Kyutai's web port; 5 s without a client's audio frees its conversation, "
    "where serve waits 30 s for its TTS clients; the page opens in your browser). Every flag "
    "of `serve` works here.",
    {
        "moshi": "",
        "port": 8998,
        "client_silence_timeout": 5.0,
        "browser": True,
    },
)
STT = Preset(
    "stt --serve",
    "Kyutai's streaming STT websocket (/api/asr-streaming): `serve --stt` on port 8080 "
    "(Kyutai's STT clients' default); --hf-repo and the weight flags name the STT model, "
    "--text-temp and --text-top-k its sampling (default greedy, as `stt`). Every flag of "
    "`serve` works here.",
    {"stt": DEFAULT_STT_REPO, "port": 8080, "text_temp": GREEDY.temp, "text_top_k": GREEDY.top_k},
    weights_of="stt",
)


def build_parser(preset: Preset = SERVE) -> argparse.ArgumentParser:
    """The flags of `serve`, with `preset`'s defaults."""
    parser = CliParser(
        prog=invoked_as(preset.command),
        description=textwrap.fill(preset.description, 88),
        epilog=preset.epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models = parser.add_argument_group("models (at least one)")
    models.add_argument(
        "--moshi",
        nargs="?",
        const="",
        metavar="REPO|FOLDER",
        help=f"Moshi, PersonaPlex or Hibiki: /api/chat and the page at / (default repo "
        f"{DEFAULT_REPO}; the weight, sampling and persona flags below are its)",
    )
    models.add_argument(
        "--stt",
        nargs="?",
        const=DEFAULT_STT_REPO,
        metavar="REPO|FOLDER",
        help=f"speech to text (default repo {DEFAULT_STT_REPO})",
    )
    models.add_argument(
        "--tts",
        nargs="?",
        const=DEFAULT_TTS_REPO,
        metavar="REPO|FOLDER",
        help=f"text to speech (default repo {DEFAULT_TTS_REPO})",
    )
    models.add_argument("--llm", metavar="REPO|FOLDER", help="an mlx-lm chat model")
    models.add_argument(
        "--max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="the LLM's answer length when the client sets none, as Unmute does (default "
        "%(default)s tokens, over a minute of speech)",
    )
    add_alias(models, "--llm-max-tokens", dest="max_tokens", type=positive_int)
    models.add_argument(
        "--voice-repo",
        default=DEFAULT_VOICE_REPO,
        metavar="REPO|FOLDER",
        help="the TTS voices (default %(default)s)",
    )
    _add_server_args(parser)
    add_model_args(parser)
    add_persona_args(parser)
    parser.set_defaults(**{"client_silence_timeout": SILENCE_TIMEOUT_SECONDS, **preset.defaults})
    return parser


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default="localhost",
        help="address to listen on (default %(default)s, which is 127.0.0.1; 0.0.0.0 for "
        "other devices)",
    )
    server.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help="port (default %(default)s)"
    )
    server.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept only clients that send this key (kyutai-api-key header, ?auth_id=, or "
        "OpenAI's bearer token); repeat for several; without it any client is accepted",
    )
    server.add_argument(
        "--ssl", metavar="DIR", help="serve https with DIR/key.pem and DIR/cert.pem"
    )
    server.add_argument(
        "--static",
        metavar="DIR",
        help="serve this folder at / instead of our page (e.g. Kyutai's built web client)",
    )
    server.add_argument(
        "--browser",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="open the page in a browser once the chat model is ready (default: %(default)s)",
    )
    server.add_argument(
        "--max-conversations",
        type=positive_int,
        default=1,
        metavar="N",
        help="chat conversations at once; more clients are told the server is busy (default "
        "%(default)s)",
    )
    add_max_lag_arg(server)
    server.add_argument(
        "--max-streams",
        type=positive_int,
        default=8,
        metavar="N",
        help="live STT streams, stepped as one batch (default %(default)s)",
    )
    server.add_argument(
        "--max-buffered-seconds",
        type=positive_float,
        default=SttServerConfig.max_buffered_seconds,
        metavar="SECONDS",
        help="drop an STT client whose audio waiting for the model exceeds this (default "
        "%(default)s)",
    )
    server.add_argument(
        "--max-tts-streams",
        type=positive_int,
        default=2,
        metavar="N",
        help="live TTS streams, stepped as one batch per sampling (default %(default)s, as "
        "Kyutai's local config)",
    )
    add_limit_args(server)


def main(argv: Sequence[str] | None = None, preset: Preset = SERVE) -> int:
    """Entry point of `serve` (and of its presets, `web` and `stt --serve`)."""
    parser = build_parser(preset)
    return run_cli(lambda args: _run(parser.parse_args(args), preset), argv)


def _run(args: argparse.Namespace, preset: Preset) -> int:
    _check(args, preset)
    if args.memory_plan:
        return print_memory_plan(args)
    if args.list_voices:
        return print_voice_names(args)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    asyncio.run(_serve(args, preset))
    return 0


_WEIGHT_FLAGS = ("moshi_weight", "mimi_weight", "tokenizer", "lm_config", "quantize")


def _check(args: argparse.Namespace, preset: Preset) -> None:
    """Every flag checked before anything loads; `ConfigError` for a bad one."""
    if preset.weights_of == "stt":
        if args.hf_repo is not None:
            args.stt, args.hf_repo = args.hf_repo, None
    elif args.moshi:
        args.hf_repo = args.moshi
    elif args.hf_repo is not None and args.moshi is None:
        args.moshi = ""  # --hf-repo names the chat model: serve it
    if args.moshi is None:
        about_chat = ["memory_plan"] * args.memory_plan + ["list_voices"] * args.list_voices
        if preset.weights_of == "moshi":
            about_chat += [name for name in _WEIGHT_FLAGS if getattr(args, name) is not None]
        if about_chat:
            flag = "--" + about_chat[0].replace("_", "-")
            raise ConfigError(f"{flag} is about the chat model: add --moshi")
    if args.memory_plan or args.list_voices:
        return
    if args.moshi is None and not (args.stt or args.tts or args.llm):
        raise ConfigError("give at least one model: --moshi, --stt, --tts or --llm")
    if args.api_key is not None and not all(args.api_key):
        raise ConfigError("--api-key must not be empty")
    max_lag_frames(args)
    limits_from_args(args)
    if args.moshi is not None:
        check_persona_args(args)
        static_dir = Path(args.static) if args.static else PAGE_DIR
        if not (static_dir / "index.html").is_file():
            raise ConfigError(f"--static {static_dir}: no index.html in that folder")
    if args.ssl:
        ssl_context(args.ssl)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ssl_context(folder: str) -> ssl.SSLContext:
    """A server context from `folder/cert.pem` and `folder/key.pem`."""
    cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
    for path in (cert, key):
        if not path.is_file():
            raise ConfigError(f"--ssl {folder}: {path.name} not found (see README: https)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=cert, keyfile=key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"--ssl {folder}: cannot use cert.pem/key.pem: {exc}") from None
    return context


def _chat_service(args: argparse.Namespace, thread: ModelThread) -> ChatService:
    settings = ChatSettings(
        sampling=sampling_from_args(args),
        seed=args.seed,
        max_lag_frames=max_lag_frames(args),
        max_conversations=args.max_conversations,
        static_dir=(Path(args.static) if args.static else PAGE_DIR).resolve(),
        voice=args.voice,
        role=args.role,
        cfg_coef=args.cfg_coef,
    )
    return ChatService(thread, lambda: load_model(args), settings)


def _load_stt(args: argparse.Namespace, preset: Preset) -> SttModel:
    if preset.weights_of != "stt":
        return SttModel.load(args.stt)
    return SttModel.load(args.stt, **file_options(args))


async def _load(args: argparse.Namespace, preset: Preset, context: ServeContext) -> None:
    """The STT, TTS and LLM, loaded on the model thread (MLX state belongs to the thread);
    the chat model loads while the server listens."""
    thread = context.thread
    if args.stt:
        _say(f"loading STT {args.stt}...")
        context.stt = await thread.call(lambda: _load_stt(args, preset))
        context.add_model("stt", args.stt)
    if args.tts:
        _say(f"loading TTS {args.tts}...")
        context.tts = await thread.call(lambda: TtsModel.load(args.tts, voice_repo=args.voice_repo))
        context.add_model("tts", args.tts)
        tts = context.tts
        if not tts.clones_only:
            _say(await asyncio.to_thread(default_voice_status, tts.config, tts.voice_repo))
        else:  # no default voice to look for: tts-0.75b-en-public
            _say(f"TTS: {CLONED_VOICES_ONLY}")
    if args.llm:
        _say(f"loading LLM {args.llm}...")
        context.llm = await thread.call(
            lambda: LlmModel.load(args.llm, default_max_tokens=args.max_tokens)
        )
        context.add_model("llm", args.llm)


def server_url(host: str, port: int, secure: bool) -> str:
    """The address a browser opens for `--host` and `--port` (an IPv6 host in brackets)."""
    name = f"[{host}]" if ":" in host else host
    return f"{'https' if secure else 'http'}://{name}:{port}"


async def _serve(args: argparse.Namespace, preset: Preset) -> None:
    stop_on_sigterm()
    host = "127.0.0.1" if args.host == "localhost" else args.host
    limits = fitted_limits(limits_from_args(args), _say)
    tally = EventTally(log)
    thread = ModelThread()
    thread.start()
    context = ServeContext(
        thread,
        tally,
        limits,
        api_keys=frozenset(args.api_key or ()),
        max_streams=args.max_streams,
        max_tts_streams=args.max_tts_streams,
        max_buffered_seconds=args.max_buffered_seconds,
        loopback_only=is_loopback(host),
        voice_repo=args.voice_repo,
    )
    if preset.weights_of == "stt":
        context.stt_sampling = Sampling(args.text_temp, args.text_top_k)
    try:
        await _load(args, preset, context)
        if args.moshi is not None:
            context.chat = _chat_service(args, thread)
            context.add_model("moshi", args.hf_repo or DEFAULT_REPO)  # /v1/realtime's ?model=
        secure = ssl_context(args.ssl) if args.ssl else None
        guard = ConnectionGuard(replace(limits), tally)
        runner = await guard.serve(create_app(context, guard), host, args.port, secure)
        try:
            url = server_url(args.host, args.port, secure is not None)
            _warn(args, context)
            if context.chat is not None:  # pages are served, websockets pinged meanwhile
                _say(f"serving {url} (loading {args.hf_repo or DEFAULT_REPO}, warming it up...)")
                await asyncio.wrap_future(context.chat.start())  # its error ends the command
            _ready(args, context, url)
            tallying = asyncio.create_task(tally.run())
            try:
                await asyncio.Event().wait()
            finally:
                tallying.cancel()
        finally:
            await runner.cleanup()
    finally:
        if context.chat is not None:
            context.chat.stop()
        await asyncio.to_thread(thread.stop)


def _warn(args: argparse.Namespace, context: ServeContext) -> None:
    """Warn where anyone may use the models, or browsers will refuse the microphone."""
    if not context.loopback_only and not context.api_keys:
        _say(f"warning: anyone who can reach {args.host} may use these models; set --api-key")
    if context.chat is not None and not context.loopback_only and not args.ssl:
        _say(
            f"warning: serving plain http on {args.host}: browsers on other machines will "
            "refuse the microphone; use --ssl DIR (see README: talk from a phone)"
        )


def _ready(args: argparse.Namespace, context: ServeContext, url: str) -> None:
    """Say what is served where, and what memory it takes; open the page."""
    _say(memory_plan_line(context))
    served = []
    if context.chat is not None:
        chat = context.chat
        served.append(
            f"the chat page at / (model loaded in {chat.load_seconds:.1f} s, warmed up in "
            f"{chat.warmup_seconds:.1f} s)"
        )
    if context.stt is not None:
        served.append("STT at /api/asr-streaming")
    if context.tts is not None:
        served.append("TTS at /api/tts_streaming")
    if context.stt is not None or context.tts is not None or context.llm is not None:
        served.append("OpenAI's API at /v1")
    if context.stt is not None and context.tts is not None and context.llm is not None:
        clones_only = context.tts.clones_only  # a clone's id names the voice
        served.append(f"the assistant at {ASSISTANT_PAGE}{'?voice=ID' if clones_only else ''}")
    _say(f"ready: {url} ({'; '.join(served)}); Ctrl-C to stop")
    if args.browser and context.chat is not None:
        if context.api_keys:  # the page passes its address's key on to /api/chat
            url += "/?" + urlencode({API_KEY_QUERY: min(context.api_keys)})
        # A launcher may block until the browser exits: not on the loop.
        threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
