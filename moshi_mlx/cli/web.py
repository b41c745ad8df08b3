"""Talk to Moshi in a browser: a server of Kyutai's chat protocol and our page.

    python -m moshi_mlx.local_web [--host HOST] [--port 8998] [--ssl DIR] [weight flags]

With PersonaPlex, `--voice` and `--role` are the default persona; the page (or NVIDIA's
client, through `voice_prompt` and `text_prompt` on `/api/chat`) may choose another.

The browser's echo cancellation keeps Moshi from hearing itself, so this is the way to talk
without headphones. Kyutai's clients (its web client served with `--static`,
`python -m moshi.client`) work against it unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import sys
import threading
import webbrowser
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from moshi_mlx.cli.common import (
    CliParser,
    add_limit_args,
    add_max_lag_arg,
    add_model_args,
    add_persona_args,
    check_persona_args,
    exit_at_once,
    limits_from_args,
    load_model,
    max_lag_frames,
    port,
    positive_int,
    print_memory_plan,
    print_voice_names,
    run_cli,
    sampling_from_args,
)
from moshi_mlx.errors import ConfigError
from moshi_mlx.serve.chat.server import PAGE_DIR, ServerConfig, create_app, log
from moshi_mlx.serve.chat.worker import ModelWorker
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.http import is_loopback
from moshi_mlx.serve.limits import fitted_limits
from moshi_mlx.serve.sessions import stop_on_sigterm


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(
        prog="python -m moshi_mlx.local_web",
        description="Serve Moshi to a browser (Kyutai's chat protocol on /api/chat).",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--host", default="localhost", help="address to listen on (default %(default)s)"
    )
    server.add_argument("--port", type=port, default=8998, help="port (default %(default)s)")
    server.add_argument(
        "--static", metavar="DIR", help="serve this folder (e.g. Kyutai's built web client)"
    )
    server.add_argument(
        "--ssl", metavar="DIR", help="serve https with DIR/key.pem and DIR/cert.pem"
    )
    server.add_argument(
        "--no-browser", action="store_true", help="do not open the page once the model is ready"
    )
    add_max_lag_arg(server)
    server.add_argument(
        "--max-conversations",
        type=positive_int,
        default=1,
        metavar="N",
        help="conversations at once; more connections are told the server is busy",
    )
    add_limit_args(server)
    add_model_args(parser)
    add_persona_args(parser)
    return parser.parse_args(argv)


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


def server_url(host: str, port: int, secure: bool) -> str:
    """The address a browser opens for `--host` and `--port` (an IPv6 host in brackets)."""
    name = f"[{host}]" if ":" in host else host
    return f"{'https' if secure else 'http'}://{name}:{port}"


def server_config(args: argparse.Namespace) -> ServerConfig:
    """Per-connection settings from the flags (checked before the model loads)."""
    static_dir = Path(args.static) if args.static else PAGE_DIR
    if not (static_dir / "index.html").is_file():
        raise ConfigError(f"--static {static_dir}: no index.html in that folder")
    return ServerConfig(
        sampling=sampling_from_args(args),
        seed=args.seed,
        max_lag_frames=max_lag_frames(args),
        max_conversations=args.max_conversations,
        static_dir=static_dir.resolve(),
        loopback_only=is_loopback(args.host),
        limits=limits_from_args(args),
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _serve(args: argparse.Namespace, started: threading.Event) -> None:
    stop_on_sigterm()
    config = server_config(args)
    context = ssl_context(args.ssl) if args.ssl else None
    config = replace(config, limits=fitted_limits(config.limits, _say))
    worker = ModelWorker(lambda: load_model(args), config.sampling, args.voice, args.role)
    guard = ConnectionGuard(config.limits, EventTally(log))
    runner = await guard.serve(create_app(worker, config, guard), args.host, args.port, context)
    worker.start()  # pages and websockets are served (with pings) while the model loads
    started.set()
    url = server_url(args.host, args.port, secure=context is not None)
    if not is_loopback(args.host) and context is None:
        _say(
            f"warning: serving plain http on {args.host}: browsers on other machines will refuse "
            "the microphone; use --ssl DIR (see README: talk from a phone)"
        )
    _say(f"serving {url} (loading and warming up the model...)")
    try:
        while not worker.ready.is_set():
            await asyncio.sleep(0.1)
        if worker.error is not None:
            raise worker.error
        _say(
            f"ready: open {url} (model loaded in {worker.load_seconds:.1f} s, warmed up in "
            f"{worker.warmup_seconds:.1f} s); Ctrl-C to stop"
        )
        if not args.no_browser:  # a launcher may block until the browser exits: not on the loop
            threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def _run(argv: Sequence[str] | None, started: threading.Event) -> int:
    args = parse_args(argv)
    if args.memory_plan:
        return print_memory_plan(args)
    if args.list_voices:
        return print_voice_names(args)
    check_persona_args(args)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    asyncio.run(_serve(args, started))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx.local_web` (`moshi-mlx-web`)."""
    started = threading.Event()
    code = run_cli(lambda args: _run(args, started), argv)
    if started.is_set():
        # Connections are closed; the model thread may be inside a step (seconds on a slow CPU).
        exit_at_once(code)
    return code
