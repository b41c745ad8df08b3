"""Token sampling of one stream (text, or audio codebooks): `Sampling(temp, top_k)`.

Randomness always comes from a `mx.random` key passed in by the caller (the stepper owns
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

from moshi_mlx.errors import removed_names

MAX_SEED = 2**32 - 1  # seeds are 32-bit, as the 4 random bytes drawn when none is given


@dataclass(frozen=True)
class Sampling:
    """How the tokens of one stream are drawn: temperature (0: greedy, the most likely
    token) and top-k (0: every token). A product takes one per stream it samples (the chat's
    and the TTS's text and audio, the STT's text)."""

    temp: float = 0.0
    top_k: int = 0

    @property
    def draws(self) -> bool:
        """Whether the tokens are drawn at random (temp > 0), so take noise."""
        return self.temp > 0

    def sample(self, logits: mx.array, key: mx.array) -> mx.array:
        """Logits (B, V) -> tokens (B,) int32, drawn with the noise of `key`."""
        noise = gumbel_noise(logits.shape, key) if self.draws else None
        return self.sample_with_noise(logits, noise)

    def sample_with_noise(self, logits: mx.array, noise: mx.array | None) -> mx.array:
        """`sample` with its Gumbel noise given, of the logits' shape (B, V)
        (`gumbel_noise`; None when not `draws`)."""
        return mx.argmax(self._scores(logits, noise), axis=-1).astype(mx.int32)

    def sample_column(self, logits: mx.array, noise: mx.array | None) -> mx.array:
        """`sample_with_noise` as argmax leaves it: a (B, 1) uint32 column, no squeeze and no
        cast (a depformer slice's token, looked up by the next slice as a column and cast
        once per step with the others: `Depformer.sample_step`)."""
        return mx.argmax(self._scores(logits, noise), axis=-1, keepdims=True)

    def _scores(self, logits: mx.array, noise: mx.array | None) -> mx.array:
        """What the sample is the argmax of: the logits when greedy, else logits / temp plus
        the noise, -inf outside the top k."""
        if not self.draws:
            return logits
        scores = logits.astype(mx.float32) / self.temp + noise
        vocab = logits.shape[-1]
        if 0 < self.top_k < vocab:
            kth = vocab - self.top_k  # the k-th largest logit, in ascending order
            threshold = mx.partition(logits, kth=kth, axis=-1)[..., kth : kth + 1]
            scores = mx.where(logits >= threshold, scores, -mx.inf)
        return scores


GREEDY = Sampling()


def guided_logits(logits: mx.array, cfg_coef: float) -> mx.array:
    """Classifier-free guidance as Kyutai's `LMGen` mixes it: logits (2B, V), the B
    conditioned rows then their B null rows -> `null + (conditioned - null) * cfg_coef` (B, V)."""
    rows = logits.shape[0] // 2
    conditioned, null = logits[:rows], logits[rows:]
    return null + (conditioned - null) * cfg_coef


def split_key(key: mx.array, count: int = 2) -> list[mx.array]:
    """`mx.random.split(key, count)`'s keys, each (2,), the same bits: its (count, 2) draw
    read as one row and split there (one reshape and one split), not split into (1, 2) rows
    and each squeezed."""
    return mx.split(mx.random.split(key, count).reshape(-1), count)


def gumbel_noise(shape: tuple[int, ...], key: mx.array) -> mx.array:
    """Standard Gumbel noise (float32) of `shape` from `key`."""
    return mx.random.gumbel(shape, key=key)


__getattr__ = removed_names(
    __name__,
    {
        "SamplingConfig": "SamplingConfig is now one Sampling(temp, top_k) per stream "
        "(moshi_mlx.runtime.sampling): text_sampling=Sampling(0.7, 25), "
        "audio_sampling=Sampling(0.8, 250)",
        "sample": "sample(logits, temp, top_k, key) is now Sampling(temp, top_k).sample"
        "(logits, key) (moshi_mlx.runtime.sampling)",
    },
)
