"""`python -m moshi_mlx.local_web` is now `python -m moshi_mlx web`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("local_web", "web")
