"""The forms a compiled step reads the model in: the same numbers, fewer operations.

Each is explained, with its measured effect, in docs/step_tricks.md:

- `StepWeight`: a weight in the form a step reads it, made once before the step is traced
  (a Linear's transposed view, an RMSNorm's float32 copy, a dequantized low-rank table, the
  cross-attention's query rows), kept while the weight is the same array.
- `rope_tables`: one position's RoPE (interleaved pairs or split halves, grouped heads) as
  cos and sin tables as wide as the fused q/k/v projection and each feature's partner (one
  gather), shared by every layer of a step, the queries' scale folded in.
- `rounded_sum`: the residual stream held widened to float32 between layers, rounded to the
  half type at each sum, so that no norm casts its input again.
- `lookup_column`: a sampled token column (B, 1) looked up with one gather per part, no
  slices or squeezes (`picked_rows`: a table's rows, quantized parts dequantized).
- `split_last`: an array split into more parts than one MLX split makes (10; beyond, a slice
  per part) in groups: the TTS's 32 codebooks' noise in 4 splits, not 32 slices.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

QUANTIZED_PARTS = ("weight", "scales", "biases")  # a quantized layer's arrays (MLX's names)
Quantization = tuple[int, int, str]  # group size, bits, mode
RopeTables = tuple[mx.array, mx.array, mx.array]  # `rope_tables`' cos, sin, partners


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


def _rope_constants(
    heads: tuple[int, int], head_dim: int, query_scale: float, interleaved: bool
) -> dict[str, np.ndarray]:
    """Per feature of a fused q/k/v projection of one position ((H + 2 H_kv) heads of
    head_dim): its pair's frequency exponent, the sine's sign, a factor (q: `query_scale`,
    k: 1, v: 0) and cos's offset (v: 1), and the feature RoPE pairs it with (`partners`,
    (1, width) int32): its neighbour (`interleaved`), else the one half a head away."""
    query_heads, kv_heads = heads
    half = head_dim // 2
    within = np.arange(head_dim)
    if interleaved:
        pair, sign, partner = within // 2, within % 2, within ^ 1
    else:
        pair, sign, partner = within % half, within // half, (within + half) % head_dim
    per_head = np.repeat([query_scale, 1.0, 0.0], [query_heads, kv_heads, kv_heads])
    offsets = np.repeat([0.0, 0.0, 1.0], [query_heads, kv_heads, kv_heads])
    rows = len(per_head)
    partners = np.arange(rows)[:, None] * head_dim + partner[None, :]
    return {
        "exponents": np.tile(-pair, rows).astype(np.float32),
        "signs": np.tile(2.0 * sign - 1.0, rows).astype(np.float32),
        "factors": np.repeat(per_head, head_dim).astype(np.float32),
        "offsets": np.repeat(offsets, head_dim).astype(np.float32),
        "partners": partners.reshape(1, -1).astype(np.int32),
    }


def rope_tables(
    position: mx.array,
    head_dim: int,
    base: float,
    dtype: mx.Dtype,
    heads: tuple[int, int],
    query_scale: float = 1.0,
    interleaved: bool = True,
) -> RopeTables:
    """RoPE at `position` over a fused q/k/v projection of one position, (B, (H + 2 H_kv)
    head_dim) for `heads` (H, H_kv): cos and sin tables of that width and each feature's
    partner, so that `x * cos + take_along_axis(x, partners, axis=1) * sin` rotates the q and
    k parts (q also scaled by `query_scale`: attention's scale, in the rotation's one fused
    operation rather than one of its own) and multiplies v by 1 and 0. Pairs are adjacent
    (`interleaved`) or i and i + head_dim / 2. The angles are computed as `mx.fast.rope`
    computes them, so the rotated values are the same."""
    constants = _rope_constants(heads, head_dim, query_scale, interleaved)
    exponents, signs, factors, offsets = (
        mx.array(constants[name]) for name in ("exponents", "signs", "factors", "offsets")
    )
    log_step = mx.array(math.log(base) / (head_dim // 2), mx.float32)
    theta = position.astype(mx.float32) * mx.exp(exponents * log_step)
    cos_table = (mx.cos(theta) * factors + offsets).astype(dtype)
    sin_table = (mx.sin(theta) * signs * factors).astype(dtype)
    return cos_table, sin_table, mx.array(constants["partners"])


MAX_SPLIT_PARTS = 10  # MLX splits into at most this many parts in one operation, else slices


def split_last(x: mx.array, starts: list[int]) -> list[mx.array]:
    """x split along its last axis at `starts` in as few operations as MLX allows: one split
    of up to `MAX_SPLIT_PARTS` parts (more: a slice per part), else the parts in groups of
    that many, each split again."""
    if len(starts) < MAX_SPLIT_PARTS:
        return mx.split(x, starts, axis=-1)
    heads = starts[MAX_SPLIT_PARTS - 1 :: MAX_SPLIT_PARTS]
    bounds = [0, *heads, x.shape[-1]]
    parts = []
    for first, last, group in zip(bounds, bounds[1:], mx.split(x, heads, axis=-1)):
        inner = [start - first for start in starts if first < start < last]
        parts += split_last(group, inner) if inner else [group]
    return parts


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
