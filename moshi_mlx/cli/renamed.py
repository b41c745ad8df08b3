"""Names a user may have typed that are gone: each says, in one line, what replaced it, and
exits with code 2. The per-command scripts (`moshi-mlx-web`, ...) and module shims
(`python -m moshi_mlx.local_web`, ...) became `moshi-mlx <command>` and
`python -m moshi_mlx <command>`; only `python -m moshi_mlx.local` stays as it was."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from moshi_mlx.cli.common import USER_ERROR_EXIT


def refuse(old: str, new: str) -> NoReturn:
    """Print that `old` is now `new` (one line on stderr) and exit with code 2."""
    print(f"error: `{old}` is now `{new}`", file=sys.stderr)
    sys.exit(USER_ERROR_EXIT)


def _script(command: str) -> Callable[[], NoReturn]:
    """The entry point of the old script `moshi-mlx-<command>`."""
    return lambda: refuse(f"moshi-mlx-{command}", f"moshi-mlx {command}")


local = _script("local")
infer = _script("infer")
quantize = _script("quantize")
web = _script("web")
stt = _script("stt")
tts = _script("tts")


def module(name: str, command: str) -> NoReturn:
    """`python -m moshi_mlx.<name>`, now `python -m moshi_mlx <command>`."""
    refuse(f"python -m moshi_mlx.{name}", f"python -m moshi_mlx {command}")
