"""Kyutai's streaming speech-to-text (and the words of Hibiki's translation) on moshi_mlx."""
