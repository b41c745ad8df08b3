"""A key/value cache over a sliding attention window, with flat memory for any length."""

from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Ring buffer holding the keys and values of the last `capacity` positions.

    A query at position t attends to positions t - capacity + 1 .. t (itself included), as in
    Kyutai's PyTorch reference. Memory is allocated once, at the first update, and stays flat
    however long the stream runs. `offset` is the absolute position of the next token.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: mx.array | None = None  # (B, H, capacity, D)
        self.values: mx.array | None = None
        self.offset = 0  # absolute position of the next token
        self._write = 0  # ring index the next single token is written to

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for reuse)."""
        self.offset = 0
        self._write = 0

    @property
    def state(self) -> list[mx.array]:
        """The cached keys and values (none before the first update)."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def length(self) -> int:
        """How many positions the cache holds (at most `capacity`)."""
        return min(self.offset, self.capacity)

    def _allocate(self, like_keys: mx.array, like_values: mx.array) -> None:
        batch, heads, _, _ = like_keys.shape
        shape_k = (batch, heads, self.capacity, like_keys.shape[-1])
        shape_v = (batch, heads, self.capacity, like_values.shape[-1])
        self.keys = mx.zeros(shape_k, like_keys.dtype)
        self.values = mx.zeros(shape_v, like_values.dtype)

    def _chronological(self) -> tuple[mx.array, mx.array]:
        """The cached keys and values, oldest first."""
        assert self.keys is not None and self.values is not None
        n = self.length
        if self.offset <= self.capacity:
            return self.keys[:, :, :n], self.values[:, :, :n]
        order = [*range(self._write, self.capacity), *range(self._write)]
        index = mx.array(order)
        return self.keys[:, :, index], self.values[:, :, index]

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, mx.array | None]:
        """Add T new positions; return the keys, values and mask the new queries attend with.

        keys, values: (B, H, T, D). The mask is None when every returned position is visible to
        every query (always the case for T == 1), else a boolean (T, L) array.
        """
        if self.keys is None or self.keys.shape[0] != keys.shape[0]:
            self._allocate(keys, values)
        steps = keys.shape[2]
        if steps == 1:
            return self._update_one(keys, values)
        return self._update_many(keys, values)

    def _update_one(self, keys: mx.array, values: mx.array):
        i = self._write
        self.keys[:, :, i : i + 1] = keys
        self.values[:, :, i : i + 1] = values
        self.offset += 1
        self._write = (i + 1) % self.capacity
        if self.offset < self.capacity:
            return self.keys[:, :, : self.offset], self.values[:, :, : self.offset], None
        # Full ring: order does not matter to attention (RoPE was applied before caching).
        return self.keys, self.values, None

    def _update_many(self, keys: mx.array, values: mx.array):
        steps = keys.shape[2]
        past_keys, past_values = self._chronological()
        past = past_keys.shape[2]
        all_keys = mx.concatenate([past_keys, keys], axis=2)
        all_values = mx.concatenate([past_values, values], axis=2)
        query_pos = mx.arange(past, past + steps)[:, None]
        key_pos = mx.arange(past + steps)[None, :]
        delta = query_pos - key_pos
        mask = (delta >= 0) & (delta < self.capacity)
        # Keep the newest `capacity` positions, oldest first, so the ring restarts at index 0.
        kept = min(self.capacity, past + steps)
        self.keys[:, :, :kept] = all_keys[:, :, -kept:]
        self.values[:, :, :kept] = all_values[:, :, -kept:]
        self.offset += steps
        self._write = kept % self.capacity
        return all_keys, all_values, mask
