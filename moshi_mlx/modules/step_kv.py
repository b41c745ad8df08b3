"""The depformer's key/value cache of one step (`StepKV`): its slices' keys and values, grown
by concatenation in compiled code, behind mlx-lm's cache protocol
(`moshi_mlx.modules.kv_cache.LayerCache`)."""

from __future__ import annotations

import mlx.core as mx


class StepKV:
    """The keys and values of a stack of layers over one step's short sequence (the
    depformer's slices: position k is slice k), grown by concatenation in `mx.compile`d code.
    Every position's count is known when the step is traced, so a query attends to exactly
    the positions written, with no mask and no slot arithmetic (`KVRing`'s per-position
    work). For sequences no longer than a window: nothing is ever evicted."""

    def __init__(self, layers: int, dtype: mx.Dtype):
        self.keys: list[mx.array | None] = [None] * layers
        self.values: list[mx.array | None] = [None] * layers
        self.length = 0  # positions written by every layer
        self.dtype = dtype

    def layers(self) -> list[StepKVLayer]:
        """Each layer, as the `LayerCache` its attention updates and reads."""
        return [StepKVLayer(self, index) for index in range(len(self.keys))]

    def advanced(self) -> StepKV:
        """This cache after a position written by every layer."""
        self.length += 1
        return self


class StepKVLayer:
    """One layer of a `StepKV`, as a `LayerCache`."""

    quantization = None

    def __init__(self, cache: StepKV, index: int):
        self.cache = cache
        self.index = index

    @property
    def offset(self) -> mx.array:
        """The position of the next token (a () int32 array, for RoPE)."""
        return mx.array(self.cache.length, mx.int32)

    @property
    def dtype(self) -> mx.Dtype:
        return self.cache.dtype

    def make_mask(self, steps: int) -> None:
        """None: a query sees every position written."""
        return

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add one position's keys and values (B, H, 1, D); return all written."""
        cache, index = self.cache, self.index
        if cache.keys[index] is not None:
            keys = mx.concatenate([cache.keys[index], keys], axis=2)
            values = mx.concatenate([cache.values[index], values], axis=2)
        cache.keys[index], cache.values[index] = keys, values
        return keys, values
