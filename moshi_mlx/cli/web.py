"""`python -m moshi_mlx web`: talk with Moshi in a browser, a preset of `serve --moshi`.

The browser's echo cancellation keeps Moshi from hearing itself, so this is the way to talk
without headphones. Kyutai's clients (its web client served with `--static`,
`python -m moshi.client`) work against it unchanged. With PersonaPlex, `--voice` and `--role`
are the default persona; the page (or NVIDIA's client, through `voice_prompt` and
`text_prompt` on `/api/chat`) may choose another.
"""

from __future__ import annotations

from collections.abc import Sequence

from moshi_mlx.cli import serve


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx web`."""
    return serve.main(argv, serve.WEB)
