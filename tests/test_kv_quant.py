"""Attention over a quantized KV cache against the unquantized one."""

import mlx.core as mx
import pytest

from moshi_mlx.modules.kv_quant import KVQuantization


@pytest.mark.parametrize("bits, limit", [(8, 2e-2), (4, 1.5e-1)])
def test_quantized_attention_tracks_sdpa(bits, limit):
    quantization = KVQuantization.of(bits)
    keys_shape = (1, 4, 300, 64)
    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    keys = mx.random.normal(keys_shape, key=mx.random.key(1))
    values = mx.random.normal(keys_shape, key=mx.random.key(2))
    mask = mx.arange(300) < 200  # the last 100 slots are not written yet
    scale = 64**-0.5
    expected = mx.fast.scaled_dot_product_attention(
        queries, keys[:, :, :200], values[:, :, :200], scale=scale
    )
    packed = quantization.attention(
        queries, quantization.quantize(keys), quantization.quantize(values), scale, mask
    )
    error = (mx.linalg.norm(packed - expected) / mx.linalg.norm(expected)).item()
    print(f"{bits}-bit attention: relative error {error:.2e}")
    assert packed.shape == expected.shape and error < limit


def test_empty_buffers_have_the_packed_shapes():
    quantization = KVQuantization.of(4, 64)
    data, scales, biases = quantization.empty((1, 2, 16, 128), mx.bfloat16)
    reference = quantization.quantize(mx.zeros((1, 2, 16, 128), mx.bfloat16))
    assert [a.shape for a in (data, scales, biases)] == [a.shape for a in reference]
    assert data.dtype == mx.uint32 and scales.dtype == biases.dtype == mx.bfloat16
