"""RoPE as a compiled step applies it: cos and sin tables of one position, shared by every
layer, over a fused q/k/v projection (`Attention._project_one`)."""

from __future__ import annotations

import math

import mlx.core as mx


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
) -> tuple[mx.array, mx.array]:
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
