"""Attention over a quantized KV cache against the unquantized one."""

import mlx.core as mx
import pytest

from moshi_mlx.errors import ConfigError
from moshi_mlx.modules.kv_quant import KVQuantization


@pytest.mark.parametrize("bits, limit", [(8, 2e-2), (4, 1.5e-1)])
def test_quantized_attention_tracks_sdpa(bits, limit):
    quantization = KVQuantization.of(bits)
    keys_shape = (1, 4, 300, 64)
    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    keys = mx.random.normal(keys_shape, key=mx.random.key(1))
    values = mx.random.normal(keys_shape, key=mx.random.key(2))
    # 200 positions written: the older 192 read packed, the newest 8 from the recent ring.
    mask = mx.concatenate([mx.arange(300) < 192, mx.ones(8, mx.bool_)])
    scale = 64**-0.5
    expected = mx.fast.scaled_dot_product_attention(
        queries, keys[:, :, :200], values[:, :, :200], scale=scale
    )

    def buffer(x):
        return (*quantization.quantize(x), x[:, :, 192:200])

    packed = quantization.attention(queries, buffer(keys), buffer(values), scale, mask)
    error = (mx.linalg.norm(packed - expected) / mx.linalg.norm(expected)).item()
    print(f"{bits}-bit attention: relative error {error:.2e}")
    assert packed.shape == expected.shape and error < limit


def test_recent_positions_are_read_unquantized():
    quantization = KVQuantization.of(4)
    shape = (1, 2, 64, 32)
    queries = mx.random.normal((1, 2, 1, 32), key=mx.random.key(0))
    keys = mx.random.normal(shape, key=mx.random.key(1))
    values = mx.random.normal(shape, key=mx.random.key(2))
    recent = slice(40, 48)  # only the recent ring is visible: exact attention over it

    def buffer(x):
        return (*quantization.quantize(x), x[:, :, recent])

    mask = mx.concatenate([mx.zeros(64, mx.bool_), mx.ones(8, mx.bool_)])
    out = quantization.attention(queries, buffer(keys), buffer(values), 32**-0.5, mask)
    expected = mx.fast.scaled_dot_product_attention(
        queries, keys[:, :, recent], values[:, :, recent], scale=32**-0.5
    )
    assert mx.allclose(out, expected, atol=1e-5)


def test_empty_buffers_have_the_packed_shapes():
    quantization = KVQuantization.of(4, 64)
    data, scales, biases, recent = quantization.empty((1, 2, 16, 128), mx.bfloat16, 8)
    reference = quantization.quantize(mx.zeros((1, 2, 16, 128), mx.bfloat16))
    assert [a.shape for a in (data, scales, biases)] == [a.shape for a in reference]
    assert data.dtype == mx.uint32 and scales.dtype == biases.dtype == mx.bfloat16
    assert recent.shape == (1, 2, 8, 128) and recent.dtype == mx.bfloat16


def test_a_group_size_needs_bits():
    assert KVQuantization.chosen(None) is None
    assert KVQuantization.chosen(4, 64) == KVQuantization(4, 64)
    with pytest.raises(ConfigError, match="kv_group_size needs kv_bits"):
        KVQuantization.chosen(None, 64)
