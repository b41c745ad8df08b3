"""The delayed tokens the three steppers share, and the cache of what they compile per model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.errors import MoshiError
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.delayed_tokens import UNGENERATED, DelayedTokens, delayed_tokens_width
from moshi_mlx.runtime.model_memo import ModelMemo, model_memo


def test_delayed_writes_are_fed_at_their_delay_and_read_back_as_frames():
    """Frame f's token of stream k, written at its delay, is fed at step f + delays[k] (the
    start token before); after step t, `frame_out` reads frame t + 1 - max_delay whole."""
    config = LmConfig.tiny()
    ring, delays = DelayedTokens.of(config), np.array(config.delays)
    assert ring.width == delayed_tokens_width(config)
    streams = len(delays)
    tokens = ring.empty(2)  # a batch of two rows of streams
    assert tokens.shape == (2, streams, ring.width) and (np.array(tokens) == UNGENERATED).all()

    def frame(f: int) -> np.ndarray:  # (2, K): distinct per row, stream and frame
        return 1000 * np.arange(2)[:, None] + 10 * f + np.arange(streams)[None]

    for t in range(3 * ring.width):
        step = mx.array(t, mx.int32)
        tokens = ring.write_delayed(tokens, step, mx.array(frame(t)))
        fed = np.array(ring.inputs(tokens, step))
        for k, delay in enumerate(delays):
            expected = config.start_tokens[k] if t <= delay else frame(t - delay)[:, k]
            np.testing.assert_array_equal(fed[:, k], expected)
        if t + 1 >= ring.max_delay:
            out = np.array(ring.frame_out(tokens, step))
            np.testing.assert_array_equal(out, frame(t + 1 - ring.max_delay))


def test_column_writes_touch_only_their_rows():
    config = LmConfig.tiny()
    ring = DelayedTokens.of(config)
    tokens = ring.empty()
    step = mx.array(5, mx.int32)
    tokens = ring.write_column(tokens, step, mx.array([7, 8]), slice(1, 3))
    written = np.array(tokens)
    np.testing.assert_array_equal(written[1:3, 5 % ring.width], [7, 8])
    written[1:3, 5 % ring.width] = UNGENERATED
    assert (written == UNGENERATED).all()
    np.testing.assert_array_equal(ring.column(tokens, step, slice(0, 3)), [UNGENERATED, 7, 8])


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize(
    "rows", [slice(None), slice(1, None), slice(2, 3), slice(9, 10), slice(3, 10)]
)
@pytest.mark.parametrize("host_delays", [True, False])
def test_a_fresh_write_is_read_as_it_leaves_the_column(lag, rows, host_delays):
    """`column(tokens, t, fresh=(values, rows, lag))` of the tokens before the write is the
    column of the tokens `write_delayed(tokens, t + lag, values, rows)` leaves, in every row
    (each stream of `rows` whose lag + delay is 0 from the values), with or without the
    delays on the host."""
    config = LmConfig.tiny()
    ring = DelayedTokens.of(config)
    if not host_delays:
        ring = DelayedTokens(ring.delays, ring.start_tokens, ring.max_delay, ring.width)
    streams = len(config.delays)
    rng = np.random.default_rng(lag)
    tokens = mx.array(rng.integers(0, 100, (2, streams, ring.width)).astype(np.int32))
    count = len(range(*rows.indices(streams)))
    values = mx.array(rng.integers(100, 200, (2, count)).astype(np.int32))
    for t in range(2 * ring.width):
        step = mx.array(t, mx.int32)
        written = ring.write_delayed(tokens, step + lag, values, rows)
        fresh = ring.column(tokens, step, fresh=(values, rows, lag))
        np.testing.assert_array_equal(fresh, ring.column(written, step))
        inputs = ring.inputs(tokens, step, (values, rows, lag))
        np.testing.assert_array_equal(inputs, ring.inputs(written, step))


def test_a_model_memo_keeps_its_latest_choices_for_its_model_only():
    model, made = object(), []
    cache: ModelMemo[str] = ModelMemo(model, size=2)
    for choice in ("a", "b", "a", "c"):
        cache.get(choice, lambda choice=choice: made.append(choice) or choice.upper())
    assert made == ["a", "b", "c"] and cache.choices() == ["a", "c"]
    assert model_memo(model, cache) is cache
    assert model_memo(model, None).choices() == []
    with pytest.raises(MoshiError, match="another model"):
        model_memo(object(), cache)
