"""`python -m moshi_mlx <command>` (and the `moshi-mlx` script): one way into every tool."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from moshi_mlx.cli.common import USER_ERROR_EXIT

# command -> (module under moshi_mlx.cli, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "local": ("local", "talk with Moshi through the microphone and speakers"),
    "web": ("web", "talk with Moshi in a browser (Kyutai's chat protocol)"),
    "infer": ("infer", "answer (or translate) a wav file offline"),
    "quantize": ("quantize", "write 8- or 4-bit weights of a model"),
    "stt": ("stt", "speech to text: a file, the microphone, or a streaming server"),
    "tts": ("tts", "text to speech: to a wav file or the speakers"),
    "serve": ("serve", "STT, TTS and an LLM on one port (moshi-server and OpenAI protocols)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return (
        "usage: python -m moshi_mlx <command> [flags]   (flags: python -m moshi_mlx <command> -h)"
        "\n\ncommands:\n" + "\n".join(lines)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run `argv[0]`'s command with the rest of `argv`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else USER_ERROR_EXIT
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"error: no command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return USER_ERROR_EXIT
    module = importlib.import_module(f"moshi_mlx.cli.{COMMANDS[command][0]}")
    return module.main(rest)
