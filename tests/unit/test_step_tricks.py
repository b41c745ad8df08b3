"""The attention path's step forms give the numbers of the plain layer code, bit for bit."""

import mlx.core as mx
import pytest

from moshi_mlx.modules.step_kv import StepKV
from moshi_mlx.modules.step_tricks import rope_tables
from moshi_mlx.modules.transformer import Attention, TransformerConfig, scaled_dot_product_attention


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    ("embedding", "kv_repeat"), [("rope", 1), ("rope_concat", 1), ("rope_concat", 2)]
)
def test_one_position_rope_is_mx_fast_rope(embedding, kv_repeat, dtype):
    """One position's q/k/v through `rope_tables` (each feature's partner gathered): keys and
    values are `mx.fast.rope`'s and the projection's bit for bit, queries the same rotation
    scaled by head_dim^-0.5, for interleaved and split-halves RoPE, grouped heads or not."""
    config = TransformerConfig(
        64, 4, 1, 96, context=8, positional_embedding=embedding, kv_repeat=kv_repeat
    )
    mx.random.seed(4)
    attention = Attention(config)
    attention.set_dtype(dtype)
    x = mx.random.normal((2, config.d_model)).astype(dtype)
    position = mx.array(37, mx.int32)
    heads = (config.num_heads, config.num_kv_heads)
    rope = rope_tables(
        position,
        config.head_dim,
        config.max_period,
        dtype,
        heads,
        config.head_dim**-0.5,
        config.rope_interleaved,
    )
    queries, keys, values = attention._project_one(x, rope)
    expected = attention._project(x[:, None], position)
    assert mx.array_equal(keys, expected[1]).item()
    assert mx.array_equal(values, expected[2]).item()
    scaled = (expected[0].astype(mx.float32) * config.head_dim**-0.5).astype(dtype)
    assert mx.allclose(queries, scaled, rtol=1e-2 if dtype == mx.bfloat16 else 1e-6).item()


def test_attention_over_one_position_is_its_values():
    """A query over one position (a depformer's first slice) gets that position's values, as
    `mx.fast`'s attention does, bit for bit."""
    mx.random.seed(5)
    queries, keys, values = (mx.random.normal((2, 4, 1, 16)).astype(mx.bfloat16) for _ in "qkv")
    cache = StepKV(1, mx.bfloat16).layers()[0]
    out = scaled_dot_product_attention(queries, keys, values, cache, 0.25, None)
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25)
    assert mx.array_equal(out, expected).item() and mx.array_equal(out, values).item()
