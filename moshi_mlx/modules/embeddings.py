"""Token embeddings: a plain table, or Kyutai's low-rank and two-stream variants.

A low-rank table holds vectors of `rank` widened by a linear layer (`low_rank`): the TTS's
depformer embeds its 2049 audio tokens with rank 128. A two-stream ("demux") table reads a
token that packs two, `(second + 1) * rows + first` (second -1: none), looks both up in the
one table and sums their projections `out1(first) + out2(second)`: the TTS's text stream
carries the word being spoken and a word ahead. Parameter names equal Kyutai's
(`weight`, `low_rank.weight`, `out1.weight`, `out2.weight`). Token -1 ("no input") is zeroed
by the caller (`moshi_mlx.models.depformer.embed`). The table quantizes like an
`nn.QuantizedEmbedding` (`weight` packed, `scales`, `biases`), its linears like any Linear.
Plain tables of one shape stack (`StackedTables`): one lookup then embeds a token of each.
A column of sampled tokens (B, 1) is looked up without squeezes (`lookup_column`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
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


def lookup_column(table: nn.Module, column: mx.array) -> mx.array:
    """The vectors (B, dim) of a column of tokens (B, 1) >= 0 (as `sample_column` leaves
    them): of a plain table (an `nn.Embedding`, an unquantized `TokenEmbedding` of one
    stream) one gather along its rows, no squeezes; of any other its lookup of the tokens."""
    if type(table) is nn.Embedding:
        return mx.take_along_axis(table.weight, column, axis=0)
    if isinstance(table, TokenEmbedding) and not table.demux and table.quantization is None:
        rows = mx.take_along_axis(table.weight, column, axis=0)
        return table.low_rank(rows) if "low_rank" in table else rows
    return table(column[:, 0])


@dataclass(frozen=True)
class StackedTables:
    """Plain tables of one shape (`nn.Embedding`s, e.g. the LM's audio streams) as one
    (count * rows, dim) array whose row ranges the tables' weights are views of (no memory
    added once evaluated): a step looks up a token of every table in one gather, not one
    lookup (gather, squeeze) per table."""

    flat: mx.array
    views: tuple[mx.array, ...]
    offsets: mx.array  # (count, 1) int32: table k's first row in `flat`

    @classmethod
    def of(cls, tables: Sequence[nn.Module]) -> StackedTables | None:
        """Stack `tables`, their weights replaced by views of the stack (lazy: the caller
        evaluates `flat`); None unless they are plain `nn.Embedding`s of one shape."""
        if not tables or any(type(table) is not nn.Embedding for table in tables):
            return None
        weights = [table.weight for table in tables]
        if len({weight.shape for weight in weights}) != 1:
            return None
        rows = weights[0].shape[0]
        flat = mx.concatenate(weights)
        views = tuple(flat[k * rows : (k + 1) * rows] for k in range(len(tables)))
        for table, view in zip(tables, views):
            table.weight = view
        offsets = mx.array(np.arange(len(tables), dtype=np.int32)[:, None] * rows)
        return cls(flat, views, offsets)

    def holds(self, tables: Sequence[nn.Module]) -> bool:
        """Whether `tables`' weights are still this stack's views (none was replaced)."""
        return len(tables) == len(self.views) and all(
            table.get("weight") is view for table, view in zip(tables, self.views)
        )

    def __call__(self, tokens: mx.array) -> mx.array:
        """tokens (B, count, T) >= 0, a token of each table -> vectors (B, count, T, dim)."""
        return self.flat[tokens + self.offsets]
