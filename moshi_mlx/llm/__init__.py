"""Chat LLMs on mlx-lm, for a speech server's replies: `LlmModel` (load, generate one step per
`next()`, prompt caches reused across a conversation's turns)."""

from moshi_mlx.llm.model import DEFAULT_MAX_TOKENS, LlmError, LlmModel, TextPiece, Usage

__all__ = ["DEFAULT_MAX_TOKENS", "LlmError", "LlmModel", "TextPiece", "Usage"]
