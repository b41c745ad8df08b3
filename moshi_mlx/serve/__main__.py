"""`python -m moshi_mlx.serve` is now `python -m moshi_mlx serve`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("serve", "serve")
