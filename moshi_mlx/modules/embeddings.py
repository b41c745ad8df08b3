"""Token embeddings: a plain table, or Kyutai's low-rank and two-stream variants.

A low-rank table holds vectors of `rank` widened by a linear layer (`low_rank`): the TTS's
depformer embeds its 2049 audio tokens with rank 128. A two-stream ("demux") table reads a
token that packs two, `(second + 1) * rows + first` (second -1: none), looks both up in the
one table and sums their projections `out1(first) + out2(second)`: the TTS's text stream
carries the word being spoken and a word ahead. Parameter names equal Kyutai's
(`weight`, `low_rank.weight`, `out1.weight`, `out2.weight`). Token -1 ("no input") is zeroed
by the caller (`moshi_mlx.models.depformer.embed`). The table quantizes like an
`nn.QuantizedEmbedding` (`weight` packed, `scales`, `biases`), its linears like any Linear.
Plain tables of one width, quantized alike or not, stack (`StackedTables`): one lookup then
embeds a token of each, "no input" (-1) included. A column of sampled tokens (B, 1) is looked up without slices or
squeezes (`step_tricks.lookup_column`), a quantized table's packed rows, scales and biases
alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from moshi_mlx.modules.linear import Linear
from moshi_mlx.modules.step_tricks import (
    QUANTIZED_PARTS,
    StepWeight,
    dequantized,
    picked_rows,
    quantization_of,
)


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
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.dequantized: StepWeight | None = None

    def transpose_weight(self) -> mx.array | None:
        """`transpose_weights`' hook: a quantized low-rank table (rows `rank` wide: small, the
        TTS depformer's 32 are 18 MB in bf16 at tts-1.6b) is dequantized once for the step
        (`dequantized`, the same values), so a lookup is one gather, not three and a
        dequantization; the table, for the caller to evaluate (None: other tables)."""
        if self.quantization is None or "low_rank" not in self:
            return None
        self.dequantized = StepWeight.kept(
            self.dequantized, self.weight, lambda _: picked_rows(self, lambda part: part)
        )
        return self.dequantized.view

    def step_table(self) -> mx.array | None:
        """The table `dequantized` for the step, while it is of the current weight."""
        return StepWeight.current(self.dequantized, self.weight)

    def quantize_table(self, group_size: int, bits: int, mode: str = "affine") -> None:
        """Quantize the table in place (its linears are quantized as Linears)."""
        self.weight, self.scales, self.biases = mx.quantize(
            self.weight, group_size=group_size, bits=bits, mode=mode
        )
        self.quantization = (group_size, bits, mode)

    def _rows(self, tokens: mx.array) -> mx.array:
        return picked_rows(self, lambda part: part[tokens])

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


@dataclass(frozen=True)
class StackedTables:
    """Plain tables of one width (`nn.Embedding`s, e.g. the LM's text and audio streams,
    quantized alike or not) as one array per part (`weight`; a quantized table's `scales` and
    `biases`): the tables' rows one after the other, whose row ranges the tables' parts are
    views of (no memory added once evaluated), then one row of zeros (a quantized one's: zero
    scales and biases) that "no input" (-1) reads. A step looks up a token of every table in
    one gather per part (and one dequantization), not one lookup (gathers, squeezes,
    dequantization) per table and a test of each token."""

    flat: dict[str, mx.array]  # part name -> (rows of every table + 1, ...)
    views: tuple[dict[str, mx.array], ...]  # per table, part name -> its rows of `flat`
    offsets: mx.array  # (count,) int32: table k's first row in `flat`
    zero_row: int  # the row of zeros
    quantization: tuple[int, int, str] | None  # group size, bits, mode

    @classmethod
    def of(cls, tables: Sequence[nn.Module]) -> StackedTables | None:
        """Stack `tables`, their parts replaced by views of the stack (lazy: the caller
        evaluates `flat`); None unless they are `nn.Embedding`s of one width and dtype, all
        plain or all `nn.QuantizedEmbedding`s quantized alike."""
        kinds = {type(table) for table in tables}
        if kinds not in ({nn.Embedding}, {nn.QuantizedEmbedding}):
            return None
        quantization = {quantization_of(table) for table in tables}
        names = [name for name in QUANTIZED_PARTS if name in tables[0]]
        widths = {tuple((t[name].shape[1:], t[name].dtype) for name in names) for t in tables}
        if len(quantization) != 1 or len(widths) != 1:
            return None
        starts = np.cumsum([0] + [table.weight.shape[0] for table in tables])
        flat = {
            name: mx.concatenate(
                [*(table[name] for table in tables), mx.zeros_like(tables[0][name][:1])]
            )
            for name in names
        }
        views = tuple(
            {name: part[starts[k] : starts[k + 1]] for name, part in flat.items()}
            for k in range(len(tables))
        )
        for table, table_views in zip(tables, views):
            table.update(table_views)
        offsets = mx.array(starts[:-1].astype(np.int32))
        return cls(flat, views, offsets, int(starts[-1]), quantization.pop())

    def holds(self, tables: Sequence[nn.Module]) -> bool:
        """Whether `tables`' parts are still this stack's views (none was replaced)."""
        return len(tables) == len(self.views) and all(
            table.get(name) is view
            for table, table_views in zip(tables, self.views)
            for name, view in table_views.items()
        )

    def __call__(self, tokens: mx.array) -> mx.array:
        """tokens (B, count, ...), a token of each table or -1 ("no input") -> vectors
        (B, count, ..., dim), zero for -1."""
        offsets = self.offsets  # (count,): one position's
        if tokens.ndim > 2:
            offsets = offsets.reshape(-1, *([1] * (tokens.ndim - 2)))
        rows = mx.where(tokens < 0, self.zero_row, tokens + offsets)
        return dequantized(
            {name: part[rows] for name, part in self.flat.items()}, self.quantization
        )
