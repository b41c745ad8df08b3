"""Key/value caches over a sliding attention window, with flat memory for any length.

Every layer cache speaks mlx-lm's protocol (`LayerCache`): `offset`, `make_mask(steps)` for
the queries of the next `steps` positions, then `update_and_fetch(keys, values) -> (keys,
values)` to attend to. Three kinds: Mimi's `KVCache` (one per layer, Python positions), the
temporal transformer's `KVRing` (every layer's buffers as arrays, for compiled steps; its
`layers()`), and the depformer's `StepKV` (one step's slices, grown by concatenation:
`moshi_mlx.modules.step_kv`). The stateful ones save and restore through `state` /
`meta_state` / `from_state` (`moshi_mlx.modules.streaming`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import mlx.core as mx
import numpy as np

from moshi_mlx.modules.kv_quant import KVQuantization, Quantized, recent_slots
from moshi_mlx.modules.streaming import BaseState

Buffer = mx.array | Quantized  # one layer's keys (or values): plain, or quantized
Mask = mx.array | str | None  # a boolean mask, "causal", or None: every position visible


class LayerCache(Protocol):
    """What one layer's attention passes its keys and values through (mlx-lm's cache
    protocol): `offset`, the position of the next token (an int, or a () int32 array in
    compiled steps); `quantization`, how its buffers are packed (None: plain)."""

    offset: int | mx.array
    quantization: KVQuantization | None

    def make_mask(self, steps: int) -> Mask:
        """The mask of the next `steps` positions' queries over what `update_and_fetch`
        will return (asked before it)."""
        ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Add the keys and values (B, H, T, D) of T positions; the keys and values to
        attend to."""
        ...


class KVCache(BaseState):
    """Ring buffer holding the keys and values of the last `capacity` positions.

    A query at position t attends to positions t - capacity + 1 .. t (itself included), as in
    Kyutai's PyTorch reference. Memory is allocated once, at the first update, and stays flat
    however long the stream runs. `offset` is the absolute position of the next token.
    """

    quantization = None

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

    @state.setter
    def state(self, state: list[mx.array]) -> None:
        self.keys, self.values = state if state else (None, None)

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Capacity, absolute position of the next token, and its ring index."""
        return tuple(map(str, (self.capacity, self.offset, self._write)))

    @meta_state.setter
    def meta_state(self, meta_state: tuple[str, ...]) -> None:
        self.capacity, self.offset, self._write = map(int, meta_state)

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

    def make_mask(self, steps: int) -> mx.array | None:
        """None for one position (it sees every cached one); for T > 1 a boolean (T, L)
        array: each query sees itself and the `capacity - 1` positions before it."""
        if steps == 1:
            return None
        past = self.length
        query_pos = mx.arange(past, past + steps)[:, None]
        key_pos = mx.arange(past + steps)[None, :]
        delta = query_pos - key_pos
        return (delta >= 0) & (delta < self.capacity)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add T new positions (B, H, T, D); the keys and values their queries attend to
        (under `make_mask(T)`)."""
        if self.keys is None or self.keys.shape[0] != keys.shape[0]:
            self._allocate(keys, values)
        steps = keys.shape[2]
        if steps == 1:
            return self._update_one(keys, values)
        return self._update_many(keys, values)

    def _update_one(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        i = self._write
        self.keys[:, :, i : i + 1] = keys
        self.values[:, :, i : i + 1] = values
        self.offset += 1
        self._write = (i + 1) % self.capacity
        if self.offset < self.capacity:
            return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]
        # Full ring: order does not matter to attention (RoPE was applied before caching).
        return self.keys, self.values

    def _update_many(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        steps = keys.shape[2]
        past_keys, past_values = self._chronological()
        past = past_keys.shape[2]
        all_keys = mx.concatenate([past_keys, keys], axis=2)
        all_values = mx.concatenate([past_values, values], axis=2)
        # Keep the newest `capacity` positions, oldest first, so the ring restarts at index 0.
        kept = min(self.capacity, past + steps)
        self.keys[:, :, :kept] = all_keys[:, :, -kept:]
        self.values[:, :, :kept] = all_values[:, :, -kept:]
        self.offset += steps
        self._write = kept % self.capacity
        return all_keys, all_values


FIRST_BUCKET = 64  # slots of a fresh `KVRing`
LARGE_BUCKET = 512  # past this many slots, capacities grow by this step instead of doubling


def ring_capacity(positions: int, context: int) -> int:
    """Slots a `KVRing` needs for `positions` cached positions: a bucket that doubles from
    `FIRST_BUCKET` to `LARGE_BUCKET`, then grows by `LARGE_BUCKET`s, at most `context`.

    For Moshi's 3000 positions: 64, 128, 256, 512, 1024, ..., 2560, 3000 (9 buckets, so the
    step is compiled 9 times per conversation), and a step never attends over more than 511
    empty slots (at most twice the written ones).
    """
    capacity = FIRST_BUCKET
    while capacity < min(positions, LARGE_BUCKET):
        capacity *= 2
    if positions > capacity:
        capacity = -(-positions // LARGE_BUCKET) * LARGE_BUCKET
    return min(capacity, context)


class KVRing(BaseState):
    """The keys and values of a stack of layers for one-position steps in `mx.compile`d code.

    Everything a step reads is an array, so one trace serves every step of a capacity:
    `position` (a () int32 array) is the absolute position of the next token, written at slot
    `position % context`; `keys` and `values` hold one (B, H, capacity, head_dim) buffer per
    layer. A query attends to the `min(position + 1, capacity)` written slots (a boolean mask),
    which is the window of `context` positions once the ring wraps, as in `KVCache`. With a
    `quantization`, each buffer is that layout's packed slots plus its small unquantized ring
    of the newest positions (slot `position % recent_slots`; see `modules.kv_quant`), and the
    mask covers both, each position visible in exactly one of them.

    The capacity starts at `FIRST_BUCKET` slots and grows in the buckets of `ring_capacity`
    (`grown`, outside compiled code) up to `context`, so early steps do not attend over
    thousands of empty slots; at full context the memory is the same flat ring as `KVCache`'s.

    Rows (streams) may start at different positions: `starts` (B,) int32, the position at
    which each row's stream began (None: all at 0). A row attends only to the positions it
    wrote since its start, so a stream that joins at position p (`with_row_started`) sees no
    earlier row's keys; RoPE being relative, its attention is that of a stream started at 0,
    up to float rounding.
    """

    def __init__(
        self,
        keys: list[Buffer],
        values: list[Buffer],
        position: mx.array,
        context: int,
        quantization: KVQuantization | None = None,
        starts: mx.array | None = None,
    ):
        self.keys = list(keys)
        self.values = list(values)
        self.position = position
        self.context = context
        self.quantization = quantization
        self.starts = starts

    @classmethod
    def empty(
        cls,
        layers: int,
        shape: tuple[int, int, int],
        dtype: mx.Dtype,
        context: int,
        quantization: KVQuantization | None = None,
    ) -> KVRing:
        """A ring at position 0; `shape` is (B, H, head_dim) of one position's keys."""
        batch, heads, head_dim = shape
        size = (batch, heads, ring_capacity(1, context), head_dim)
        if quantization is None:
            buffers = [mx.zeros(size, dtype) for _ in range(2 * layers)]
        else:
            recent = recent_slots(context)
            buffers = [quantization.empty(size, dtype, recent) for _ in range(2 * layers)]
        position = mx.array(0, mx.int32)
        return cls(buffers[:layers], buffers[layers:], position, context, quantization)

    @property
    def state(self) -> dict[str, list[Buffer] | mx.array]:
        """Each layer's key and value buffers, the position, and the rows' starts if set."""
        state = {"keys": self.keys, "values": self.values, "position": self.position}
        return state if self.starts is None else {**state, "starts": self.starts}

    @state.setter
    def state(self, state: dict[str, list[Buffer] | mx.array]) -> None:
        def buffer(saved: Buffer | list[mx.array]) -> Buffer:  # a file's lists back to tuples
            return saved if isinstance(saved, mx.array) else tuple(saved)

        self.keys = [buffer(b) for b in state["keys"]]
        self.values = [buffer(b) for b in state["values"]]
        self.position = state["position"]
        self.starts = state.get("starts")
        for derived in ("visible", "_slot", "_recent_slot"):
            self.__dict__.pop(derived, None)

    @property
    def meta_state(self) -> tuple[str, ...]:
        """The context, then the quantization's bits and group size if any."""
        quantization = self.quantization
        both = () if quantization is None else (quantization.bits, quantization.group_size)
        return tuple(map(str, (self.context, *both)))

    @meta_state.setter
    def meta_state(self, meta_state: tuple[str, ...]) -> None:
        context, *quantization = map(int, meta_state)
        self.context = context
        self.quantization = KVQuantization(*quantization) if quantization else None

    def replaced(self, keys: list[Buffer], values: list[Buffer], position: mx.array) -> KVRing:
        """A ring of the same context, quantization and row starts over other buffers and
        position."""
        return KVRing(keys, values, position, self.context, self.quantization, self.starts)

    def with_starts(self, starts: mx.array | None) -> KVRing:
        """This ring with the rows' start positions `starts` (B,) int32 (None: all at 0)."""
        return KVRing(
            self.keys, self.values, self.position, self.context, self.quantization, starts
        )

    def with_row_started(self, row: int) -> KVRing:
        """This ring with row `row`'s stream starting at the current position: it forgets
        every position written before (they are masked, not cleared)."""
        batch = (
            self.keys[0][0].shape[0] if isinstance(self.keys[0], tuple) else self.keys[0].shape[0]
        )
        starts = mx.zeros(batch, mx.int32) if self.starts is None else self.starts
        rows = mx.arange(batch) == row
        return self.with_starts(mx.where(rows, self.position, starts).astype(mx.int32))

    @property
    def capacity(self) -> int:
        first = self.keys[0]
        return (first[0] if isinstance(first, tuple) else first).shape[2]

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype of the keys before any quantization (the activations')."""
        first = self.keys[0]
        return first[1].dtype if isinstance(first, tuple) else first.dtype

    @cached_property
    def visible(self) -> mx.array:
        """(slots,) bool: the slots a query at `position` attends to, itself included; for a
        quantized ring the packed slots of positions older than the recent window's, then the
        recent window's written slots."""
        slots = mx.array(np.arange(self.capacity, dtype=np.int32))  # a constant: no operation
        written = slots < mx.minimum(self.next_position, self.capacity)
        ages = (self.position - slots) % self.context  # how far back each slot's position is
        if self.quantization is None:
            return self._since_start(written, ages)
        recent = recent_slots(self.context)
        older = ages >= recent
        recent_ages = (self.position - mx.array(np.arange(recent, dtype=np.int32))) % recent
        recent_written = recent_ages <= self.position
        return mx.concatenate(
            [
                self._since_start(written & older, ages),
                self._since_start(recent_written, recent_ages),
            ],
            axis=-1,
        )

    def _since_start(self, visible: mx.array, ages: mx.array) -> mx.array:
        """`visible` (slots,) narrowed to each row's positions since its start: (B, 1, 1,
        slots) with `starts`, else as it is."""
        if self.starts is None:
            return visible
        since_start = ages[None] <= (self.position - self.starts)[:, None]
        return (visible[None] & since_start)[:, None, None]

    @cached_property
    def next_position(self) -> mx.array:
        """() int32: `position + 1`, one array for the mask, the advanced ring and a step's
        column write (a compiled step's output is never merged with an equal operation: two
        would both run)."""
        return self.position + 1

    @cached_property
    def _slot(self) -> mx.array:
        """() int32: the slot `position` is written at (MLX takes a () start index)."""
        return self.position % self.context

    @cached_property
    def _recent_slot(self) -> mx.array:
        return self.position % recent_slots(self.context)

    def _write(self, buffer: Buffer, new: mx.array) -> Buffer:
        if self.quantization is None:
            return mx.slice_update(buffer, new, self._slot, axes=(2,))
        return self.quantization.write(buffer, new, self._slot, self._recent_slot)

    def update(self, layer: int, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Write one position's keys and values (B, H, 1, D) of `layer`; return its buffers."""
        self.keys[layer] = self._write(self.keys[layer], keys)
        self.values[layer] = self._write(self.values[layer], values)
        return self.keys[layer], self.values[layer]

    def fill(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Write the first T positions' keys and values (B, H, T, D) of `layer` into a ring at
        position 0 with room for them (`grown(T)`); `replaced(..., position + T)` follows
        once every layer is written."""
        self.keys[layer] = self._fill(self.keys[layer], keys)
        self.values[layer] = self._fill(self.values[layer], values)

    def _fill(self, buffer: Buffer, new: mx.array) -> Buffer:
        start = mx.array([0], mx.int32)
        if self.quantization is None:
            return mx.slice_update(buffer, new, start, axes=(2,))
        packed = [
            mx.slice_update(part, value, start, axes=(2,))
            for part, value in zip(buffer[:3], self.quantization.quantize(new))
        ]
        # The recent window keeps the newest positions, position p at slot p % slots.
        slots, steps = buffer[3].shape[2], new.shape[2]
        if steps < slots:
            recent = mx.slice_update(buffer[3], new, start, axes=(2,))
        else:
            by_slot = [steps - slots + (s - steps) % slots for s in range(slots)]
            recent = new[:, :, mx.array(by_slot)]
        return (*packed, recent)

    def layers(self) -> list[RingLayer]:
        """Each layer of this ring, as the `LayerCache` its attention updates and reads."""
        return [RingLayer(self, index) for index in range(len(self.keys))]

    def advanced(self) -> KVRing:
        """This ring after its step: the updated buffers, at the next position."""
        return self.replaced(self.keys, self.values, self.next_position)

    def grown(self, position: int) -> KVRing:
        """This ring with room for `position` (the host's count of `position`): the next
        bucket once the written slots fill the capacity (a lazy copy; slots keep their
        index), else itself."""
        capacity = ring_capacity(position + 1, self.context)
        if capacity <= self.capacity:
            return self
        pad = [(0, 0), (0, 0), (0, capacity - self.capacity), (0, 0)]

        def grow(buffer: Buffer) -> Buffer:
            if isinstance(buffer, tuple):  # the packed slots grow, the recent window stays
                return (*(mx.pad(part, pad) for part in buffer[:3]), buffer[3])
            return mx.pad(buffer, pad)

        return self.replaced(
            [grow(b) for b in self.keys], [grow(b) for b in self.values], self.position
        )

    def trimmed(self, positions: int) -> KVRing:
        """This ring with only the slots its first `positions` positions filled (the host's
        count of `position`; all of them once it wrapped): the smaller ring to save, which
        `grown` pads back. A quantized ring's recent positions stay whole."""
        kept = min(positions, self.capacity)

        def trim(buffer: Buffer) -> Buffer:
            if isinstance(buffer, tuple):
                return (*(part[:, :, :kept] for part in buffer[:3]), buffer[3])
            return buffer[:, :, :kept]

        keys, values = [trim(b) for b in self.keys], [trim(b) for b in self.values]
        return self.replaced(keys, values, self.position)


class RingLayer:
    """One layer of a `KVRing` as a `LayerCache`: one position written at the ring's
    position (the mask its visible slots), or the first T positions filled into a ring at
    position 0 (the mask causal)."""

    def __init__(self, ring: KVRing, index: int):
        self.ring = ring
        self.index = index

    @property
    def offset(self) -> mx.array:
        """The absolute position of the next token (a () int32 array)."""
        return self.ring.position

    @property
    def quantization(self) -> KVQuantization | None:
        return self.ring.quantization

    @property
    def dtype(self) -> mx.Dtype:
        return self.ring.dtype

    def make_mask(self, steps: int) -> mx.array | str:
        """One position: the ring's `visible` slots; T positions filled: causal."""
        return self.ring.visible if steps == 1 else "causal"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Buffer, Buffer]:
        """Add keys and values (B, H, T, D); return the buffers to attend to."""
        if keys.shape[2] == 1:
            return self.ring.update(self.index, keys, values)
        self.ring.fill(self.index, keys, values)
        return keys, values
