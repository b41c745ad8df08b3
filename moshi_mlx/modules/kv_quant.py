"""A KV cache stored with MLX's affine quantization, and attention that reads it packed.

Keys and values of each position are quantized per head along the head dimension, in groups
(`mx.quantize`): 8 bits with group 64 keep attention within a percent of the unquantized
cache, 4 bits with group 32 halve the cache again. Attention multiplies the queries with the
packed keys, and the probabilities with the packed values, through `mx.quantized_matmul`: the
cache is never dequantized as a whole.

The newest `RECENT_POSITIONS` positions are also kept unquantized, in a small window of their
own (position p at slot p % its size), and attention reads them from there: a step attends
most to its recent past, and this is where 4 bits lose the most (docs/memory.md gives the
error it saves and the memory it costs).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from moshi_mlx.errors import ConfigError, Setting

KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = {8: 64, 4: 32}
RECENT_POSITIONS = 32  # the newest positions, kept unquantized beside the packed slots

# One layer's keys (or values): uint32 data, scales and biases, one per `KVRing` slot, and
# the newest positions unquantized (B, H, recent_slots, head_dim).
Quantized = tuple[mx.array, mx.array, mx.array, mx.array]


def recent_slots(context: int) -> int:
    """Slots of the unquantized recent window, for an attention window of `context`."""
    return min(RECENT_POSITIONS, context)


def _attention_dtype(dtype: mx.Dtype) -> mx.Dtype:
    # MLX's CPU quantized matmul is 7x slower with bf16 activations, scales and biases than
    # with float32 ones (114 vs 16 ms per 3000-slot 7B layer, measured): on the CPU attention
    # widens the queries and the small scales and biases. A GPU reads them as stored.
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else dtype


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
            raise ConfigError(
                Setting("kv_bits"), f" must be one of {KV_BITS}, got {bits}", parameter="kv_bits"
            )
        group_size = group_size or DEFAULT_KV_GROUP_SIZE[bits]
        if group_size not in KV_GROUP_SIZES:
            raise ConfigError(
                Setting("kv_group_size"),
                f" must be one of {KV_GROUP_SIZES}, got {group_size}",
                parameter="kv_group_size",
            )
        return cls(bits, group_size)

    @classmethod
    def chosen(cls, bits: int | None, group_size: int | None = None) -> KVQuantization | None:
        """`of(bits, group_size)`, or None (an unquantized cache) without `bits`;
        `ConfigError` for a group size without bits."""
        if bits is None and group_size is not None:
            raise ConfigError(
                Setting("kv_group_size"),
                " needs ",
                Setting("kv_bits"),
                " (8 or 4)",
                parameter="kv_group_size",
            )
        return None if bits is None else cls.of(bits, group_size)

    def check_head_dim(self, head_dim: int) -> None:
        """`ConfigError` unless the groups tile a head's keys exactly."""
        if head_dim % self.group_size:
            raise ConfigError(
                f"a {self.bits}-bit KV cache with group size {self.group_size} needs a head "
                f"dimension that divides by it; this LM's is {head_dim}"
            )

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x (..., head_dim) -> its packed form (data, scales, biases)."""
        return mx.quantize(x, group_size=self.group_size, bits=self.bits)

    def empty(self, shape: tuple[int, int, int, int], dtype: mx.Dtype, recent: int) -> Quantized:
        """A zero buffer of `shape` (B, H, slots, head_dim) packed, with `recent` slots of
        newest positions in `dtype`."""
        *lead, head_dim = shape
        groups = (*lead, head_dim // self.group_size)
        return (
            mx.zeros((*lead, head_dim * self.bits // 32), mx.uint32),
            mx.zeros(groups, dtype),
            mx.zeros(groups, dtype),
            mx.zeros((*lead[:2], recent, head_dim), dtype),
        )

    def write(
        self, buffer: Quantized, new: mx.array, slot: mx.array, recent_slot: mx.array
    ) -> Quantized:
        """`buffer` with one position new (B, H, 1, head_dim) packed into slot `slot` and kept
        as it is in slot `recent_slot` of the recent window (() int32 each)."""
        packed = [
            mx.slice_update(part, value, slot, axes=(2,))
            for part, value in zip(buffer[:3], self.quantize(new))
        ]
        return (*packed, mx.slice_update(buffer[3], new, recent_slot, axes=(2,)))

    def attention(
        self,
        queries: mx.array,
        keys: Quantized,
        values: Quantized,
        scale: float,
        mask: mx.array,
    ) -> mx.array:
        """softmax(q k^T * scale, over the `mask`ed slots) v, with packed keys and values.

        queries (B, H, T, D); keys and values as `empty` lays them out; mask (slots + recent,)
        or (T, slots + recent) bool: the packed slots, then the newest positions' slots.
        """
        q = {"group_size": self.group_size, "bits": self.bits}
        out_dtype, dtype = queries.dtype, _attention_dtype(queries.dtype)

        def widened(buffer: Quantized) -> tuple[mx.array, ...]:
            return buffer[0], buffer[1].astype(dtype), buffer[2].astype(dtype)

        queries = queries.astype(dtype) * scale
        recent_keys, recent_values = keys[3].astype(dtype), values[3].astype(dtype)
        scores = mx.concatenate(
            [
                mx.quantized_matmul(queries, *widened(keys), transpose=True, **q),
                queries @ recent_keys.swapaxes(-1, -2),
            ],
            axis=-1,
        )
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(dtype)
        slots = keys[0].shape[2]
        out = mx.quantized_matmul(weights[..., :slots], *widened(values), transpose=False, **q)
        return (out + weights[..., slots:] @ recent_values).astype(out_dtype)
