"""A KV cache stored with MLX's affine quantization, and attention that reads it packed.

Keys and values of each position are quantized per head along the head dimension, in groups
(`mx.quantize`): 8 bits with group 64 keep attention within a percent of the unquantized
cache, 4 bits with group 32 halve the cache again. Attention multiplies the queries with the
packed keys, and the probabilities with the packed values, through `mx.quantized_matmul`: the
cache is never dequantized as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from moshi_mlx.errors import ConfigError

KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = {8: 64, 4: 32}

Packed = tuple[mx.array, mx.array, mx.array]  # (uint32 data, scales, biases)


@dataclass(frozen=True)
class KVQuantization:
    """How a KV cache is quantized: `bits` 8 or 4, `group_size` 32, 64 or 128 (it must
    divide the head dimension)."""

    bits: int
    group_size: int

    @classmethod
    def of(cls, bits: int, group_size: int | None = None) -> KVQuantization:
        """`bits` with its default group size unless one is given; `ConfigError` for a choice
        MLX cannot quantize with."""
        if bits not in KV_BITS:
            raise ConfigError(f"--kv-bits must be one of {KV_BITS}, got {bits}")
        group_size = group_size or DEFAULT_KV_GROUP_SIZE[bits]
        if group_size not in KV_GROUP_SIZES:
            raise ConfigError(f"--kv-group-size must be one of {KV_GROUP_SIZES}, got {group_size}")
        return cls(bits, group_size)

    def check_head_dim(self, head_dim: int) -> None:
        """`ConfigError` unless the groups tile a head's keys exactly."""
        if head_dim % self.group_size:
            raise ConfigError(
                f"a {self.bits}-bit KV cache with group size {self.group_size} needs a head "
                f"dimension that divides by it; this LM's is {head_dim}"
            )

    def quantize(self, x: mx.array) -> Packed:
        """x (..., head_dim) -> its packed form."""
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def empty(self, shape: tuple[int, ...], dtype: mx.Dtype) -> Packed:
        """A zero buffer of (..., head_dim) values, packed."""
        *lead, head_dim = shape
        return (
            mx.zeros((*lead, head_dim * self.bits // 32), mx.uint32),
            mx.zeros((*lead, head_dim // self.group_size), dtype),
            mx.zeros((*lead, head_dim // self.group_size), dtype),
        )

    def attention(
        self,
        queries: mx.array,
        keys: Packed,
        values: Packed,
        scale: float,
        mask: mx.array | None = None,
    ) -> mx.array:
        """softmax(q k^T * scale, over the `mask`ed slots) v, with packed keys and values.

        queries (B, H, T, D); keys and values packed (B, H, L, D); mask (L,) or (T, L) bool.
        """
        q = {"group_size": self.group_size, "bits": self.bits}
        scores = mx.quantized_matmul(queries * scale, *keys, transpose=True, **q)
        if mask is not None:
            scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(queries.dtype)
        return mx.quantized_matmul(weights, *values, transpose=False, **q)
