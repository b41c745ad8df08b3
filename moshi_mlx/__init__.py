"""moshi_mlx: Kyutai's Moshi speech-text model on MLX."""

__version__ = "0.1.0"
