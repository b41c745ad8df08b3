"""`python -m moshi_mlx.stt` is now `python -m moshi_mlx stt`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("stt", "stt")
