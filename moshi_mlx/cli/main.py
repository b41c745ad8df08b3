"""`python -m moshi_mlx <command>` (and the `moshi-mlx` script): one way into every tool."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from moshi_mlx.cli.common import USER_ERROR_EXIT, package_version

# command -> (module under moshi_mlx.cli, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("local", "talk with Moshi through the microphone and speakers"),
    "web": ("web", "talk with Moshi in a browser (a preset of serve --moshi)"),
    "infer": ("infer", "answer (or translate) a wav file offline"),
    "quantize": ("quantize", "write 8- or 4-bit weights of a model"),
    "stt": ("stt", "speech to text: a file, the microphone, or a streaming server"),
    "tts": ("tts", "text to speech: to a wav file or the speakers"),
    "assistant": ("assistant", "talk to an LLM through Kyutai's STT and TTS, interruptible"),
    "serve": (
        "serve",
        "Moshi, STT, TTS and an LLM on one port (Kyutai's, moshi-server's and OpenAI's protocols)",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return (
        "usage: python -m moshi_mlx <command> [flags]   (flags: python -m moshi_mlx <command> -h;"
        " also `moshi-mlx <command>`)"
        "\n\ncommands:\n" + "\n".join(lines)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run `argv[0]`'s command with the rest of `argv`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else USER_ERROR_EXIT
    if args[0] == "--version":
        print(f"moshi_mlx {package_version()}")
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: no command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return USER_ERROR_EXIT
    module = importlib.import_module(f"moshi_mlx.cli.{COMMANDS[command][0]}")
    return module.main(rest)
