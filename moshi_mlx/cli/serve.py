"""`python -m moshi_mlx.serve`: one process, one port, one MLX thread, serving any combination
of Kyutai's STT and TTS (moshi-server's protocols) and an mlx-lm LLM (OpenAI's)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace

from moshi_mlx.checkpoints.spec import DEFAULT_STT_REPO, DEFAULT_TTS_REPO, DEFAULT_VOICE_REPO
from moshi_mlx.cli.common import (
    CliParser,
    add_limit_args,
    limits_from_args,
    port,
    positive_int,
    run_cli,
)
from moshi_mlx.errors import ConfigError
from moshi_mlx.llm import DEFAULT_MAX_TOKENS, LlmModel
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.app import create_app
from moshi_mlx.serve.assistant.server import PAGE_PATH as ASSISTANT_PAGE
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.http import is_loopback
from moshi_mlx.serve.limits import fitted_limits
from moshi_mlx.serve.memory import memory_plan_line
from moshi_mlx.serve.sessions import stop_on_sigterm
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.tts.synthesizer import TtsModel
from moshi_mlx.tts.voices import default_voice_status

# A client of these protocols may send nothing for long stretches (a TTS client listening to
# a long answer): it is pinged after half of this, and dropped without a pong within a quarter.
SILENCE_TIMEOUT_SECONDS = 30.0
# Unmute's defaults are three ports (STT 8090, TTS 8089, LLM 8091); one server serves all
# three on Unmute's STT port, and Unmute is pointed at it with its KYUTAI_*_URL variables.
DEFAULT_PORT = 8090
UNMUTE_HELP = """\
Unmute against this server (Unmute sends the key "public_token": use no --api-key, or that):
  python -m moshi_mlx.serve --stt --tts --llm REPO
  KYUTAI_STT_URL=ws://127.0.0.1:8090 KYUTAI_TTS_URL=ws://127.0.0.1:8090 \\
  KYUTAI_LLM_URL=http://127.0.0.1:8090 KYUTAI_LLM_MODEL=REPO \\
    uv run uvicorn unmute.main_websocket:app --port 8000
"""

log = logging.getLogger("moshi_mlx.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m moshi_mlx.serve",
        description="Serve Kyutai's STT and TTS (moshi-server's /api/asr-streaming, "
        "/api/tts_streaming) and an mlx-lm LLM (OpenAI's /v1) on one port.",
        epilog=UNMUTE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    models = parser.add_argument_group("models (at least one)")
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
        "--llm-max-tokens",
        type=positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="an answer's length when the client sets none, as Unmute does (default %(default)s "
        "tokens, over a minute of speech)",
    )
    models.add_argument(
        "--voice-repo",
        default=DEFAULT_VOICE_REPO,
        metavar="REPO|FOLDER",
        help="the TTS voices (default %(default)s)",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default %(default)s; localhost means IPv4)",
    )
    server.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help="port (default %(default)s: Unmute's STT port)",
    )
    server.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept only clients that send this key; repeat for several",
    )
    server.add_argument(
        "--max-streams",
        type=positive_int,
        default=8,
        metavar="N",
        help="live STT streams, stepped as one batch (default %(default)s)",
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
    parser.set_defaults(client_silence_timeout=SILENCE_TIMEOUT_SECONDS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return run_cli(lambda args: _run(parser.parse_args(args)), argv)


def _run(args: argparse.Namespace) -> int:
    if not (args.stt or args.tts or args.llm):
        raise ConfigError("give at least one model: --stt, --tts or --llm")
    if args.api_key is not None and not all(args.api_key):
        raise ConfigError("--api-key must not be empty")
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    asyncio.run(_serve(args))
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _load(args: argparse.Namespace, context: ServeContext) -> None:
    """Every model, loaded on the model thread (MLX state belongs to the thread)."""
    thread = context.thread
    if args.stt:
        _say(f"loading STT {args.stt}...")
        context.stt = await thread.call(lambda: SttModel.load(args.stt))
        context.add_model("stt", args.stt)
    if args.tts:
        _say(f"loading TTS {args.tts}...")
        context.tts = await thread.call(lambda: TtsModel.load(args.tts, voice_repo=args.voice_repo))
        context.add_model("tts", args.tts)
        tts = context.tts
        _say(await asyncio.to_thread(default_voice_status, tts.config, tts.voice_repo))
    if args.llm:
        _say(f"loading LLM {args.llm}...")
        context.llm = await thread.call(
            lambda: LlmModel.load(args.llm, default_max_tokens=args.llm_max_tokens)
        )
        context.add_model("llm", args.llm)


async def _serve(args: argparse.Namespace) -> None:
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
        loopback_only=is_loopback(host),
        voice_repo=args.voice_repo,
    )
    try:
        await _load(args, context)
        _say(memory_plan_line(context))
        guard = ConnectionGuard(replace(limits), tally)
        runner = await guard.serve(create_app(context, guard), host, args.port)
        name = f"[{host}]" if ":" in host else host
        if not context.loopback_only and not context.api_keys:
            _say(f"warning: anyone who can reach {host} may use these models; set --api-key")
        _say(f"ready: http://{name}:{args.port} (ws://{name}:{args.port}/api/...); Ctrl-C to stop")
        if context.stt is not None and context.tts is not None and context.llm is not None:
            _say(f"the assistant: http://{name}:{args.port}{ASSISTANT_PAGE} in a browser")
        tallying = asyncio.create_task(tally.run())
        try:
            await asyncio.Event().wait()
        finally:
            tallying.cancel()
            await runner.cleanup()
    finally:
        await asyncio.to_thread(thread.stop)


if __name__ == "__main__":
    sys.exit(main())
