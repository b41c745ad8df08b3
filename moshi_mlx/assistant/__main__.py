"""`python -m moshi_mlx.assistant` is now `python -m moshi_mlx assistant`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("assistant", "assistant")
