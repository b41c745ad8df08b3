"""Token sampling: greedy at temperature 0, else temperature and top-k with an explicit key.

Randomness always comes from a `mx.random` key passed in by the caller (the generator owns
its key), never from MLX's global random state, so a seeded run repeats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingConfig:
    """Temperatures and top-k for the text stream and the audio codebooks (0 = greedy)."""

    text_temp: float = 0.7
    text_top_k: int = 25
    audio_temp: float = 0.8
    audio_top_k: int = 250

    @classmethod
    def greedy(cls) -> SamplingConfig:
        """Always take the most likely token."""
        return cls(text_temp=0.0, text_top_k=0, audio_temp=0.0, audio_top_k=0)


def sample(logits: mx.array, temp: float, top_k: int, key: mx.array | None) -> mx.array:
    """Sample from logits (B, V) -> tokens (B,) int32.

    temp <= 0 takes the argmax; otherwise softmax(logits / temp), restricted to the `top_k`
    most likely tokens when 0 < top_k < V.
    """
    if temp <= 0:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    logits = logits.astype(mx.float32) / temp
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        candidates = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]  # (B, k)
        choice = mx.random.categorical(mx.take_along_axis(logits, candidates, axis=-1), key=key)
        token = mx.take_along_axis(candidates, choice[:, None], axis=-1)[:, 0]
    else:
        token = mx.random.categorical(logits, key=key)
    return token.astype(mx.int32)
