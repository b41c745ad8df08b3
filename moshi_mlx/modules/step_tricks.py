"""The forms a compiled step reads the model in: the same numbers, fewer operations.

Each is explained, with its measured effect, in docs/step_tricks.md:

- `StepWeight`: a weight in the form a step reads it, made once before the step is traced
  (a Linear's transposed view, an RMSNorm's float32 copy, a dequantized low-rank table, the
  cross-attention's query rows), kept while the weight is the same array.
- `rope_tables`: one position's RoPE (interleaved pairs or split halves, grouped heads) as
  cos and sin tables over the fused q/k/v projection, shared by every layer of a step, the
  queries' scale folded in.
- `rounded_sum`: the residual stream held widened to float32 between layers, rounded to the
  half type at each sum, so that no norm casts its input again.
- `lookup_column`: a sampled token column (B, 1) looked up with one gather per part, no
  slices or squeezes (`picked_rows`: a table's rows, quantized parts dequantized).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

QUANTIZED_PARTS = ("weight", "scales", "biases")  # a quantized layer's arrays (MLX's names)
Quantization = tuple[int, int, str]  # group size, bits, mode
RopeTables = tuple[mx.array, mx.array]  # `rope_tables`' cos and sin


@dataclass(frozen=True)
class StepWeight:
    """A weight and the form a step reads it in, made once: a Linear's transposed view
    (in, out) of its weight (out, in), a norm's float32 copy (`transformer.RMSNorm`), a
    dequantized table, a quantized linear's query rows (a dict of its parts)."""

    weight: mx.array
    view: Any

    @staticmethod
    def kept(
        made: StepWeight | None, weight: mx.array, make: Callable[[mx.array], Any]
    ) -> StepWeight:
        """`made` while it is of `weight` (the same array), else one of `make(weight)`."""
        if made is not None and made.weight is weight:
            return made
        return StepWeight(weight, make(weight))

    @staticmethod
    def current(made: StepWeight | None, weight: mx.array | None) -> Any:
        """`made`'s view while it is of `weight`, else None (the weight was replaced since:
        loading, quantizing)."""
        return made.view if made is not None and made.weight is weight else None


def _per_head(
    values: tuple[float, ...], parts: tuple[int, ...], shape: tuple[int, ...]
) -> mx.array:
    """A constant of `shape` holding values[i] for each of the parts[i] heads of part i."""
    flat = [value for value, count in zip(values, parts) for _ in range(count)]
    nested = [[[[v]]] for v in flat] if len(shape) == 4 else [[[v]] for v in flat]
    return mx.array(nested, mx.float32)


def rope_tables(
    position: mx.array,
    head_dim: int,
    base: float,
    dtype: mx.Dtype,
    query_scale: float = 1.0,
    interleaved: bool = True,
    grouped_heads: tuple[int, int] | None = None,
) -> RopeTables:
    """RoPE at `position` as cos and sin tables over a fused q/k/v projection of one position:
    the q and k parts rotate (q also scaled by `query_scale`: attention's scale, in the
    rotation's one fused operation rather than one of its own), v is multiplied by 1 and 0.
    Pairs are adjacent (`interleaved`: tables (..., head_dim / 2, 2)) or i and i + head_dim / 2
    (tables (..., 2, head_dim / 2)). The projection is viewed as (B, 3, H, pairs) with tables
    (3, 1, pairs), or with `grouped_heads` (H, H_kv) as (B, H + 2 H_kv, pairs) with tables
    (H + 2 H_kv, pairs). The angles are computed as `mx.fast.rope` computes them, so the
    rotated values are the same."""
    half = head_dim // 2
    log_step = mx.array(math.log(base) / half, mx.float32)
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * log_step)
    theta = position.astype(mx.float32) * inv_freqs
    # Per part (q, k, v) a factor and, for cos, an offset; per pair member the sine's sign.
    if grouped_heads is None:
        parts, shape = (1, 1, 1), (3, 1, 1, 1)
    else:
        heads, kv_heads = grouped_heads
        parts, shape = (heads, kv_heads, kv_heads), (heads + 2 * kv_heads, 1, 1)
    factors = _per_head((query_scale, 1.0, 0.0), parts, shape)
    offsets = _per_head((0.0, 0.0, 1.0), parts, shape)
    signs = mx.array([-1.0, 1.0], mx.float32)
    if interleaved:
        theta = theta[:, None]  # (half, 1), the signs (2,)
    else:
        theta, signs = theta[None, :], signs[:, None]  # (1, half), (2, 1)
    cos_table = (mx.cos(theta) * factors + offsets).astype(dtype)
    sin_table = (mx.sin(theta) * signs * factors).astype(dtype)
    pair = (half, 2) if interleaved else (2, half)
    table_shape = (*shape[:-2], *pair)
    return mx.broadcast_to(cos_table, table_shape), mx.broadcast_to(sin_table, table_shape)


def rounded_sum(wide: mx.array, delta: mx.array, dtype: mx.Dtype) -> mx.array:
    """`wide` (float32 holding `dtype` values) + `delta` (`dtype`), rounded to `dtype`: the
    sum `dtype` arithmetic gives. MLX adds bf16 or float16 values in float32 and rounds once;
    where a backend rounds the exact sum instead, the result is the same (float32's 24 bits
    are at least twice a half type's 8 or 11, plus 2: rounding through them never differs)."""
    return (wide + delta.astype(mx.float32)).astype(dtype)


def quantization_of(table: nn.Module) -> Quantization | None:
    """How a table is quantized (`nn.QuantizedEmbedding`, a quantized
    `embeddings.TokenEmbedding`), or None."""
    if isinstance(table, nn.QuantizedEmbedding):
        return table.group_size, table.bits, table.mode
    return getattr(table, "quantization", None)


def dequantized(parts: dict[str, mx.array], quantization: Quantization | None) -> mx.array:
    """The rows of a table's parts (`QUANTIZED_PARTS`, picked alike) as vectors: its `weight`
    when not quantized, else dequantized."""
    if quantization is None:
        return parts["weight"]
    group_size, bits, mode = quantization
    return mx.dequantize(
        parts["weight"],
        parts["scales"],
        parts.get("biases"),
        group_size=group_size,
        bits=bits,
        mode=mode,
    )


def picked_rows(table: nn.Module, pick: Callable[[mx.array], mx.array]) -> mx.array:
    """The rows `pick` takes of a table's weight; of a quantized table its packed rows, scales
    and biases picked alike, then dequantized (the values its own lookup gives), or of its
    table dequantized for the step (`TokenEmbedding.step_table`)."""
    step_table = table.step_table() if hasattr(table, "step_table") else None
    if step_table is not None:
        return pick(step_table)
    parts = {name: pick(table[name]) for name in QUANTIZED_PARTS if name in table}
    return dequantized(parts, quantization_of(table))


def lookup_column(table: nn.Module | mx.array, column: mx.array) -> mx.array:
    """The vectors (B, dim) of a column of tokens (B, 1) >= 0 (as `Sampling.sample_column`
    leaves them): of a table of one stream (an `nn.Embedding`, quantized or not, a
    `TokenEmbedding` without demux, or a table's rows as vectors) one gather along its rows
    per part (weight; a quantized one's scales and biases), no slices or squeezes; of a
    two-stream one its lookup of the tokens."""
    if isinstance(table, mx.array):
        return mx.take_along_axis(table, column, axis=0)
    if getattr(table, "demux", False):
        return table(column[:, 0])
    rows = picked_rows(table, lambda part: mx.take_along_axis(part, column, axis=0))
    return table.low_rank(rows) if "low_rank" in table else rows
