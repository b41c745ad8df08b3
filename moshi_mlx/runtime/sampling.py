"""Token sampling: greedy at temperature 0, else temperature and top-k with an explicit key.

Randomness always comes from a `mx.random` key passed in by the caller (the generator owns
its key), never from MLX's global random state, so a seeded run repeats exactly.

A sample is the Gumbel-max draw: the most likely token of logits / temp plus Gumbel noise,
among the `top_k` most likely tokens (those at least as likely as the k-th: a tie with it
joins them). It is distributed as softmax(logits / temp) over those tokens, and costs a
handful of operations: the k-th largest logit (one partition), one fused elementwise
operation and an argmax; the noise is one more (`gumbel_noise`), and a step that samples
many codebooks draws all their noise at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

MAX_SEED = 2**32 - 1  # seeds are 32-bit, as the 4 random bytes drawn when none is given


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


def gumbel_noise(shape: tuple[int, ...], key: mx.array) -> mx.array:
    """Standard Gumbel noise (float32) of `shape` from `key`."""
    return mx.random.gumbel(shape, key=key)


def sample(logits: mx.array, temp: float, top_k: int, key: mx.array | None) -> mx.array:
    """Sample from logits (B, V) -> tokens (B,) int32.

    temp <= 0 takes the argmax; otherwise softmax(logits / temp), restricted to the `top_k`
    most likely tokens when 0 < top_k < V.
    """
    noise = gumbel_noise(logits.shape, key) if temp > 0 else None
    return sample_with_noise(logits, temp, top_k, noise)


def sample_with_noise(
    logits: mx.array, temp: float, top_k: int, noise: mx.array | None
) -> mx.array:
    """`sample` with its Gumbel noise given, of the logits' shape (B, V) (`gumbel_noise`;
    None when temp <= 0)."""
    return mx.argmax(_scores(logits, temp, top_k, noise), axis=-1).astype(mx.int32)


def sample_column(logits: mx.array, temp: float, top_k: int, noise: mx.array | None) -> mx.array:
    """`sample_with_noise` as argmax leaves it: a (B, 1) uint32 column, no squeeze and no cast
    (a depformer slice's token, looked up by the next slice as a column and cast once per
    step with the others: `Depformer.sample_step`)."""
    return mx.argmax(_scores(logits, temp, top_k, noise), axis=-1, keepdims=True)


def _scores(logits: mx.array, temp: float, top_k: int, noise: mx.array | None) -> mx.array:
    """What the sample is the argmax of: the logits at temp <= 0, else logits / temp plus the
    noise, -inf outside the top k."""
    if temp <= 0:
        return logits
    scores = logits.astype(mx.float32) / temp + noise
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = vocab - top_k  # the k-th largest logit, in ascending order
        threshold = mx.partition(logits, kth=kth, axis=-1)[..., kth : kth + 1]
        scores = mx.where(logits >= threshold, scores, -mx.inf)
    return scores
