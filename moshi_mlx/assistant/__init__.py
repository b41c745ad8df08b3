"""A spoken assistant: Kyutai's STT hears the user, any mlx-lm LLM answers, Kyutai's TTS
speaks, with Unmute's turn-taking and barge-in (`python -m moshi_mlx assistant`)."""

from moshi_mlx.assistant.history import History
from moshi_mlx.assistant.pipeline import Assistant, ReplySampling
from moshi_mlx.assistant.turns import TurnRules, TurnTaker

__all__ = ["Assistant", "History", "ReplySampling", "TurnRules", "TurnTaker"]
