"""The delayed tokens every step shares: a (..., K, width) int32 buffer of the tokens each stream
is fed, written ahead by each stream's delay and read one column per step.

Step t feeds column t % width, each stream k its start token while t <= delays[k]. A token of
stream k that belongs to frame t (an input's code, a generated token) is written at column
t + delays[k]; a token sampled at step t is already delayed and is written at column t + 1.
After step t, frame t + 1 - max_delay is complete: reading each stream at its delay undoes
the delays. Leading axes (a batch of streams) ride along.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.models.config import LmConfig

UNGENERATED = -2  # a token slot not written yet

# A step's write of tokens ahead into the buffer it reads: (values (..., rows), rows, lag),
# the tokens of frame step + lag (`DelayedTokens.column`).
Fresh = tuple[mx.array, slice, int]


def delayed_tokens_width(config: LmConfig) -> int:
    """Columns of a generator's delayed tokens: from the oldest column a step reads (its output,
    `max_delay` back) to the furthest it writes (a user frame, lag and delay ahead)."""
    return config.max_delay + 2 + config.user_input_lag


@dataclass(frozen=True)
class DelayedTokens:
    """A model's streams over a delayed-token buffer: their delays, start tokens and the buffer's width.
    Its methods are lazy array functions, for compiled steps; `step` is a () int32 array."""

    delays: mx.array  # (K,) int32
    start_tokens: mx.array  # (K,) int32
    max_delay: int
    width: int
    delay_steps: tuple[int, ...] = ()  # the delays on the host (`delay_column`)

    @classmethod
    def of(cls, config: LmConfig) -> DelayedTokens:
        """The delayed tokens of `config`'s streams, `delayed_tokens_width(config)` columns wide."""
        return cls(
            delays=mx.array(config.delays, mx.int32),
            start_tokens=mx.array(config.start_tokens, mx.int32),
            max_delay=config.max_delay,
            width=delayed_tokens_width(config),
            delay_steps=tuple(config.delays),
        )

    def delay_column(self, rows: slice) -> mx.array:
        """The delays of `rows` as a (rows, 1) int32 constant: a step reads it as it is, with
        no slice of `delays` or expansion (from `delay_steps`; without them, `delays`')."""
        if not self.delay_steps:
            return self.delays[rows, None]
        return mx.array(np.array(self.delay_steps[rows], np.int32)[:, None])

    def empty(self, *batch: int) -> mx.array:
        """A buffer (*batch, K, width) with nothing written."""
        return mx.full((*batch, self.delays.shape[0], self.width), UNGENERATED, mx.int32)

    def inputs(self, tokens: mx.array, step: mx.array, fresh: Fresh | None = None) -> mx.array:
        """What step `step` feeds (..., K): its column, each stream's start token while
        step <= its delay (`fresh`: as `column`'s)."""
        column = self.column(tokens, step, fresh=fresh)
        return mx.where(step <= self.delays, self.start_tokens, column)

    def column(
        self,
        tokens: mx.array,
        step: mx.array,
        rows: slice = slice(None),
        fresh: Fresh | None = None,
    ) -> mx.array:
        """The tokens (..., rows) at step `step`'s column, as written (no start tokens): one
        dynamic slice (rows from the first: of their count) and a squeeze. `fresh` (values,
        their rows, lag): the tokens of frame step + lag that this step writes into `tokens`
        (`write_delayed`), the column read as that write leaves it: the streams whose lag +
        delay is 0 from the values, the others from `tokens`, so that the write has one reader
        (the step's last write, which it fuses with) where a read after it would be a second."""
        if fresh is not None and not self.delay_steps:  # no delays on the host: write first
            values, written, lag = fresh
            tokens, fresh = self.write_delayed(tokens, step + lag, values, written), None
        first, last, stride = rows.indices(tokens.shape[-2])
        assert stride == 1, "rows are a contiguous slice"
        if first:
            tokens, last = tokens[..., first:last, :], last - first
        size = (*tokens.shape[:-2], last, 1)
        column = mx.slice(tokens, step % self.width, (tokens.ndim - 1,), size).squeeze(-1)
        if fresh is None:
            return column
        assert (first, last) == (0, tokens.shape[-2]), "a fresh write is read in every row"
        values, written, lag = fresh
        direct = np.zeros(last, bool)
        for row in range(*written.indices(last)):
            direct[row] = lag + self.delay_steps[row] == 0
        if not direct.any():
            return column
        return mx.where(mx.array(direct), _padded(values, written, last), column)

    def write_delayed(
        self, tokens: mx.array, frame: mx.array, values: mx.array, rows: slice = slice(None)
    ) -> mx.array:
        """`tokens` with the tokens (..., rows) of frame `frame` written at their delays:
        stream k's at column frame + delays[k]."""
        return self._write(tokens, frame + self.delay_column(slice(None)), values, rows)

    def write_column(
        self, tokens: mx.array, step: mx.array, values: mx.array, rows: slice = slice(None)
    ) -> mx.array:
        """`tokens` with the tokens (..., rows) written at step `step`'s column (tokens
        sampled one step before, already delayed)."""
        return self._write(tokens, step, values, rows)

    def frame_out(
        self, tokens: mx.array, step: mx.array, rows: slice | int = slice(None)
    ) -> mx.array:
        """After step `step` wrote its tokens: those (..., rows) of frame step + 1 - max_delay
        (of one row, an int: (...)), each stream read at its delay: the one column of each row
        that a select keeps, summed (exact: integers, the others zero). The select reads the
        whole buffer, no slice of it, so that it fuses with the write before it; one row is
        kept by the select too and summed over rows and columns at once (no slice, no squeeze)."""
        columns = (
            step + 1 - self.max_delay + self.delay_column(slice(None)) + self.width
        ) % self.width
        selected = mx.array(np.arange(self.width, dtype=np.int32)) == columns  # (K, width)
        if isinstance(rows, int):
            kept = np.zeros((tokens.shape[-2], 1), bool)
            kept[rows] = True
            return mx.where(selected & mx.array(kept), tokens, 0).sum(axis=(-2, -1))
        return mx.where(selected, tokens, 0).sum(axis=-1)[..., rows]

    def _write(
        self, tokens: mx.array, columns: mx.array, values: mx.array, rows: slice
    ) -> mx.array:
        """tokens with tokens[..., k, column % width] = values[..., k] for k in `rows`, the
        columns (K, 1) one per stream, or () one for all: one select over the whole buffer
        (its few columns) against host-made constants, the values padded to every stream
        where `rows` are several but not all of them (one row's value broadcasts: the select
        keeps it in that row alone; a single value, one row of a batch of one, needs no axis
        for the columns either)."""
        count = tokens.shape[-2]
        first, last, stride = rows.indices(count)
        assert stride == 1, "rows are a contiguous slice"
        values = _padded(values, rows, count)
        in_rows = np.zeros((count, 1), bool)
        in_rows[first:last] = True
        slots = mx.array(np.arange(self.width, dtype=np.int32))  # (width,)
        written = (slots == columns % self.width) & mx.array(in_rows)  # (K, width)
        if values.size != 1:
            values = values[..., None]
        return mx.where(written, values.astype(tokens.dtype), tokens)


def _padded(values: mx.array, rows: slice, count: int) -> mx.array:
    """values (..., rows) aligned with `count` streams: padded to every stream where `rows`
    are several but not all of them; one row's values as they are (they broadcast)."""
    first, last, _ = rows.indices(count)
    if last - first > 1 and (first, last) != (0, count):
        values = mx.pad(values, [(0, 0)] * (values.ndim - 1) + [(first, count - last)])
    return values
