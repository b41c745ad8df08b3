"""The flags and the run of the speech-to-text server (`python -m moshi_mlx.stt --serve`).

The command that owns the model adds `add_server_args` to its parser and calls
`serve(args, batch_factory)` inside `moshi_mlx.cli.common.run_cli` (which prints a `MoshiError` as
one line and handles Ctrl-C); `warm_up` and `batch_factory` (rows -> an `SttBatch`) run on
the worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import replace

from moshi_mlx.cli.common import (
    add_limit_args,
    limits_from_args,
    port,
    positive_float,
    positive_int,
)
from moshi_mlx.errors import ConfigError
from moshi_mlx.serve.guard import ConnectionGuard, EventTally
from moshi_mlx.serve.http import is_loopback
from moshi_mlx.serve.limits import fitted_limits
from moshi_mlx.serve.sessions import stop_on_sigterm
from moshi_mlx.serve.stt.server import ASR_PATH, SttServerConfig, create_app, log
from moshi_mlx.serve.stt.worker import BatchFactory, SttWorker

DEFAULT_PORT = 8080  # Kyutai's STT clients connect to ws://127.0.0.1:8080 by default
WORKER_STOP_SECONDS = 5.0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags, in their own group of `parser`."""
    defaults = SttServerConfig()
    server = parser.add_argument_group("speech-to-text server")
    server.add_argument(
        "--host", default="localhost", help="address to listen on (default %(default)s)"
    )
    server.add_argument(
        "--port", type=port, default=DEFAULT_PORT, help="port (default %(default)s)"
    )
    server.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="accept only clients that send this key (kyutai-api-key header or ?auth_id=); "
        "repeat for several; without it any client is accepted",
    )
    server.add_argument(
        "--max-streams",
        type=positive_int,
        default=defaults.max_streams,
        metavar="N",
        help="streams at once; more clients are told the server is busy (default %(default)s)",
    )
    server.add_argument(
        "--max-buffered-seconds",
        type=positive_float,
        default=defaults.max_buffered_seconds,
        metavar="SECONDS",
        help="drop a client whose audio waiting for the model exceeds this (default %(default)s)",
    )
    add_limit_args(server)


def server_config(args: argparse.Namespace) -> SttServerConfig:
    """The per-connection settings of the flags; `ConfigError` for a bad value."""
    if args.api_key is not None and not all(args.api_key):
        raise ConfigError("--api-key must not be empty")
    return SttServerConfig(
        max_streams=args.max_streams,
        api_keys=frozenset(args.api_key or ()),
        max_buffered_seconds=args.max_buffered_seconds,
        loopback_only=is_loopback(args.host),
        limits=limits_from_args(args),
    )


def serve(
    args: argparse.Namespace,
    batch_factory: BatchFactory,
    warm_up: Callable[[], None] | None = None,
) -> int:
    """Serve `ASR_PATH` until Ctrl-C or SIGTERM, every stream a row of one batch of
    `--max-streams` rows; `warm_up` (load) runs first on the worker thread, then the batch is
    made and its step compiled, while clients may already connect and wait for their Ready."""
    config = server_config(args)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    asyncio.run(_serve(args, config, SttWorker(batch_factory, config.max_streams, warm_up)))
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _serve(args: argparse.Namespace, config: SttServerConfig, worker: SttWorker) -> None:
    stop_on_sigterm()
    config = replace(config, limits=fitted_limits(config.limits, _say))
    guard = ConnectionGuard(config.limits, EventTally(log))
    runner = await guard.serve(create_app(worker, config, guard), args.host, args.port)
    worker.start()
    name = f"[{args.host}]" if ":" in args.host else args.host
    url = f"ws://{name}:{args.port}{ASR_PATH}"
    if not config.loopback_only and not config.api_keys:
        _say(f"warning: anyone who can reach {args.host} may transcribe here; set --api-key")
    _say(f"serving {url} (warming up...)")
    try:
        while not worker.ready.is_set():
            await asyncio.sleep(0.1)
        if worker.error is not None:
            raise worker.error
        _say(f"ready: {url}; Ctrl-C to stop")
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await asyncio.to_thread(worker.stop, WORKER_STOP_SECONDS)
