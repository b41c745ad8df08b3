"""Every streaming state round-trips through its `state` and `meta_state`: the same arrays and
settings back, in memory and through a safetensors file, and the same outputs stepping on."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from moshi_mlx.models.mimi import Mimi, MimiConfig, MimiState
from moshi_mlx.modules.conv import Conv1d, ConvState, ConvTranspose1d, ConvTransposeState
from moshi_mlx.modules.kv_cache import KVCache, KVRing
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.streaming import (
    BaseState,
    StateTree,
    StreamingState,
    flatten_states,
    state_arrays,
    unflatten_states,
)
from moshi_mlx.modules.transformer import Transformer, TransformerConfig

FRAME = 1920


def _inputs(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def _conv() -> tuple[ConvState, Callable]:
    conv = Conv1d(3, 5, kernel_size=4, stride=2)
    state = ConvState()
    conv(_inputs((2, 6, 3), 0), state)
    return state, lambda s, seed: conv(_inputs((2, 4, 3), seed), s)


def _conv_transpose() -> tuple[ConvTransposeState, Callable]:
    conv = ConvTranspose1d(3, 5, kernel_size=4, stride=2)
    state = ConvTransposeState()
    conv(_inputs((2, 3, 3), 0), state)
    return state, lambda s, seed: conv(_inputs((2, 2, 3), seed), s)


def _transformer(context: int = 8) -> Transformer:
    config = TransformerConfig(
        d_model=64, num_heads=2, num_layers=2, ffn_hidden=64, context=context
    )
    return Transformer(config)


def _kv_cache() -> tuple[KVCache, Callable]:
    transformer = _transformer()
    caches = transformer.make_caches()
    for seed in range(10):  # past the wrap of the 8-position window
        transformer(_inputs((1, 1, 64), seed), caches)
    return caches[0], lambda cache, seed: transformer.layers[0](
        _inputs((1, 1, 64), seed), None, cache
    )


def _ring(quantization: KVQuantization | None) -> Callable:
    def build() -> tuple[KVRing, Callable]:
        transformer = _transformer(context=80)
        ring = transformer.make_ring(1, mx.float32, quantization)
        for seed in range(70):  # past the first 64-slot bucket
            ring = ring.grown(seed)
            transformer(_inputs((1, 64), seed), ring.layers())
            ring = ring.advanced()

        def step(ring: KVRing, seed: int) -> mx.array:
            return transformer(_inputs((1, 64), seed), ring.grown(70).layers())

        return ring, step

    return build


def _mimi() -> tuple[MimiState, Callable]:
    mimi = Mimi(MimiConfig.tiny())
    state = mimi.make_state()
    codes = mimi.encode_step(_inputs((1, 1, FRAME), 0), state)
    mimi.decode_step(codes, state)

    def step(state: MimiState, seed: int) -> tuple[mx.array, mx.array]:
        codes = mimi.encode_step(_inputs((1, 1, FRAME), seed), state)
        return codes, mimi.decode_step(codes, state)

    return state, step


CASES = {
    "ConvState": _conv,
    "ConvTransposeState": _conv_transpose,
    "KVCache": _kv_cache,
    "KVRing": _ring(None),
    "KVRing, 8-bit": _ring(KVQuantization.of(8, 32)),
    "MimiState": _mimi,
}


def test_every_state_class_is_covered():
    covered = {name.split(",")[0] for name in CASES}
    assert covered == set(BaseState.classes) - {"StateTree"}
    assert issubclass(MimiState, StateTree)


def _assert_same_arrays(a, b) -> None:
    flat_a, flat_b = tree_flatten(a), tree_flatten(b)
    assert [key for key, _ in flat_a] == [key for key, _ in flat_b]
    for (key, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert np.array_equal(np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32)))


@pytest.mark.parametrize("case", CASES)
def test_state_round_trips_and_steps_on_identically(case, tmp_path):
    state, step = CASES[case]()
    mx.eval(state_arrays(state))
    assert isinstance(state, StreamingState)
    rebuilt = type(state).from_state(state.state, state.meta_state)
    assert type(rebuilt) is type(state) and rebuilt.meta_state == state.meta_state
    _assert_same_arrays(rebuilt.state, state.state)

    arrays, metadata = flatten_states({"stream": state})
    mx.save_safetensors(str(tmp_path / "state.safetensors"), arrays, metadata)
    loaded = unflatten_states(*mx.load(str(tmp_path / "state.safetensors"), return_metadata=True))
    restored = loaded["stream"]
    assert type(restored) is type(state) and restored.meta_state == state.meta_state
    _assert_same_arrays(restored.state, state.state)

    for seed in (11, 12):  # the restored state steps on as the original does
        _assert_same_arrays(step(restored, seed), step(state, seed))
        mx.eval(state_arrays(state), state_arrays(restored))


def test_states_with_empty_leaves_round_trip():
    """A fresh Mimi state has no arrays; one that only encoded has none for decoding."""
    mimi = Mimi(MimiConfig.tiny())
    fresh, encoded = mimi.make_state(), mimi.make_state()
    assert state_arrays(fresh) == []
    mimi.encode_step(_inputs((1, 1, FRAME), 0), encoded)
    mx.eval(state_arrays(encoded))
    restored = unflatten_states(*flatten_states([fresh, encoded]))
    assert [s.meta_state for s in restored] == [fresh.meta_state, encoded.meta_state]
    assert state_arrays(restored[0]) == [] and restored[1].decoder_caches[0].keys is None
    _assert_same_arrays(restored[1].state, encoded.state)
    codes = mimi.encode_step(_inputs((1, 1, FRAME), 1), restored[1])
    _assert_same_arrays(codes, mimi.encode_step(_inputs((1, 1, FRAME), 1), encoded))


def test_plain_arrays_travel_beside_states():
    tree = {"tokens": mx.arange(4), "conv": _conv()[0]}
    loaded = unflatten_states(*flatten_states(tree))
    assert loaded["tokens"].tolist() == [0, 1, 2, 3]
    _assert_same_arrays(loaded["conv"].state, tree["conv"].state)


@pytest.mark.parametrize("quantization", [None, KVQuantization.of(4, 32)])
def test_a_trimmed_ring_grows_back_and_steps_on_identically(quantization):
    ring, step = _ring(quantization)()
    trimmed = ring.trimmed(70)
    assert trimmed.capacity == 70 and trimmed.position.item() == 70
    restored = unflatten_states(*flatten_states([trimmed]))[0]
    assert restored.grown(70).capacity == ring.grown(70).capacity
    _assert_same_arrays(step(restored, 11), step(ring, 11))
