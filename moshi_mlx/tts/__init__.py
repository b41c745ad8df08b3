"""Kyutai's text-to-speech (delayed streams modeling) on moshi_mlx."""
