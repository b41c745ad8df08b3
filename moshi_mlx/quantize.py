"""`python -m moshi_mlx.quantize` is now `python -m moshi_mlx quantize`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("quantize", "quantize")
