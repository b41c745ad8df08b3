"""`python -m moshi_mlx.tts` is now `python -m moshi_mlx tts`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("tts", "tts")
