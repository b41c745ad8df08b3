"""The conditioners' tables (`moshi_mlx.models.conditioners`), quantized as our quantizer
writes them."""

import mlx.core as mx
from mlx import nn

from moshi_mlx.models.condition_config import TensorConditioner
from moshi_mlx.models.conditioners import TensorTable


def test_a_quantized_tensor_conditioner_projects_like_the_float_one():
    """A quantized projection's weight is packed uint32: the voice tensor must be cast to the
    compute dtype, not to the weight's (it was, and every voice became integers: keys of 7e9)."""
    mx.random.seed(0)
    table = TensorTable(TensorConditioner("speaker_wavs", 128), 64)
    table.output_proj.weight = mx.random.normal((64, 128)) * 0.05
    voice = mx.random.normal((1, 10, 128))
    mask = mx.array([[True] * 8 + [False] * 2])
    expected = table(voice, mask)
    nn.quantize(table, group_size=64, bits=8)
    assert isinstance(table.output_proj, nn.QuantizedLinear)
    got = table(voice, mask)
    assert got.dtype == mx.float32
    assert mx.abs(got - expected).max().item() < 0.02 * mx.abs(expected).max().item()
