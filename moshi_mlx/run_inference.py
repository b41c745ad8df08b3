"""`python -m moshi_mlx.run_inference` is now `python -m moshi_mlx infer`: it says so and exits 2."""

from moshi_mlx.cli.renamed import module

module("run_inference", "infer")
