"""Token embeddings: a plain table, or Kyutai's low-rank and two-stream variants.

A low-rank table holds vectors of `rank` widened by a linear layer (`low_rank`): the TTS's
depformer embeds its 2049 audio tokens with rank 128. A two-stream ("demux") table reads a
token that packs two, `(second + 1) * rows + first` (second -1: none), looks both up in the
one table and sums their projections `out1(first) + out2(second)`: the TTS's text stream
carries the word being spoken and a word ahead. Parameter names equal Kyutai's
(`weight`, `low_rank.weight`, `out1.weight`, `out2.weight`). Token -1 ("no input") is zeroed
by the caller (`moshi_mlx.models.depformer.embed`). The table quantizes like an
`nn.QuantizedEmbedding` (`weight` packed, `scales`, `biases`), its linears like any Linear.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from moshi_mlx.modules.linear import Linear


class TokenEmbedding(nn.Module):
    """A table of `rows` tokens giving vectors of `dim`, low-rank and/or two-stream."""

    def __init__(self, rows: int, dim: int, low_rank: int | None = None, demux: bool = False):
        super().__init__()
        self.rows = rows
        self.weight = mx.zeros((rows, low_rank or dim))
        if low_rank is not None:
            # Kept even when demuxing (Kyutai's files hold it), though out1/out2 widen instead.
            self.low_rank = Linear(low_rank, dim, bias=False)
        self.demux = demux
        if demux:
            self.out1 = Linear(low_rank or dim, dim, bias=False)
            self.out2 = Linear(low_rank or dim, dim, bias=False)
        self.quantization: tuple[int, int, str] | None = None  # group size, bits, mode

    def quantize_table(self, group_size: int, bits: int, mode: str = "affine") -> None:
        """Quantize the table in place (its linears are quantized as Linears)."""
        self.weight, self.scales, self.biases = mx.quantize(
            self.weight, group_size=group_size, bits=bits, mode=mode
        )
        self.quantization = (group_size, bits, mode)

    def _rows(self, tokens: mx.array) -> mx.array:
        if self.quantization is None:
            return self.weight[tokens]
        group_size, bits, mode = self.quantization
        return mx.dequantize(
            self.weight[tokens],
            self.scales[tokens],
            self.biases[tokens],
            group_size=group_size,
            bits=bits,
            mode=mode,
        )

    def __call__(self, tokens: mx.array) -> mx.array:
        """tokens (...) >= 0 -> vectors (..., dim)."""
        if not self.demux:
            vectors = self._rows(tokens)
            return self.low_rank(vectors) if "low_rank" in self else vectors
        first = tokens % self.rows
        second = tokens // self.rows - 1
        ahead = self.out2(self._rows(mx.maximum(second, 0)))
        return self.out1(self._rows(first)) + mx.where((second < 0)[..., None], 0, ahead)


def make_embedding(
    rows: int, dim: int, low_rank: int | None = None, demux: bool = False
) -> nn.Module:
    """An `nn.Embedding` when plain (quantizable as Kyutai quantizes it), else a
    `TokenEmbedding`."""
    if low_rank is None and not demux:
        return nn.Embedding(rows, dim)
    return TokenEmbedding(rows, dim, low_rank, demux)
