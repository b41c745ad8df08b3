import mlx.core as mx
import pytest
from mlx import nn

from moshi_mlx.modules.kv_cache import KVRing, ring_capacity
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.modules.step_tricks import rounded_sum
from moshi_mlx.modules.transformer import CrossAttention, RMSNorm, Transformer, TransformerConfig

CONFIGS = [
    TransformerConfig(64, 4, 2, 96, context=5),
    TransformerConfig(
        64, 4, 2, 128, context=7, norm="layer_norm", norm_eps=1e-5, gated=False, layer_scale=0.1
    ),
]


def _windowed_reference(t: Transformer, x: mx.array) -> mx.array:
    """Full-sequence attention with an explicit window mask, no cache logic involved."""
    config = t.config
    steps = x.shape[1]
    pos = mx.arange(steps)
    delta = pos[:, None] - pos[None, :]
    mask = (delta >= 0) & (delta < config.context)
    for layer in t.layers:
        attn = layer.self_attn
        h = layer.norm1(x)
        qkv = attn.in_proj(h).reshape(1, steps, 3, config.num_heads, config.head_dim)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        q = mx.fast.rope(
            q, config.head_dim, traditional=True, base=config.max_period, scale=1.0, offset=0
        )
        k = mx.fast.rope(
            k, config.head_dim, traditional=True, base=config.max_period, scale=1.0, offset=0
        )
        scores = (q @ k.transpose(0, 1, 3, 2)) * config.head_dim**-0.5
        scores = mx.where(mask, scores, -mx.inf)
        out = mx.softmax(scores, axis=-1) @ v
        out = attn.out_proj(out.transpose(0, 2, 1, 3).reshape(1, steps, -1))
        if layer.has_layer_scale:
            out = layer.layer_scale_1(out)
        x = x + out
        ff = layer._feed_forward(layer.norm2(x))
        if layer.has_layer_scale:
            ff = layer.layer_scale_2(ff)
        x = x + ff
    return x


@pytest.mark.parametrize("config", CONFIGS)
def test_streaming_matches_windowed_full_sequence(config):
    mx.random.seed(0)
    t = Transformer(config)
    x = mx.random.normal((1, 23, config.d_model))
    expected = _windowed_reference(t, x)
    full = t(x, t.make_caches())
    caches = t.make_caches()
    one_by_one = mx.concatenate([t(x[:, i : i + 1], caches) for i in range(23)], axis=1)
    caches = t.make_caches()
    chunks = mx.concatenate([t(x[:, i : i + 4], caches) for i in range(0, 23, 4)], axis=1)
    for got in (full, one_by_one, chunks):
        assert mx.allclose(got, expected, atol=1e-5).item()
    assert caches[0].offset == 23 and caches[0].length == config.context


def test_ring_capacity_buckets():
    buckets = sorted({ring_capacity(p, 3000) for p in range(1, 4000)})
    assert buckets == [64, 128, 256, 512, 1024, 1536, 2048, 2560, 3000]
    assert all(p <= ring_capacity(p, 3000) < max(2 * p, p + 512) for p in range(64, 3001))
    assert ring_capacity(1, 16) == 16


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_compiled_ring_steps_equal_cache_steps(dtype):
    """One compiled function steps a `KVRing` across its buckets (64, 70) and past the wrap;
    every output equals the eager `KVCache` step's, bit for bit."""
    config = TransformerConfig(64, 4, 2, 96, context=70)
    mx.random.seed(1)
    t = Transformer(config)
    t.set_dtype(dtype)
    x = mx.random.normal((1, 150, config.d_model)).astype(dtype)

    def step(x, keys, values, position):
        ring = KVRing(keys, values, position, config.context)
        out = t(x, ring.layers())
        ring = ring.advanced()
        return out, ring.keys, ring.values, ring.position

    compiled = mx.compile(step)
    caches, ring = t.make_caches(), t.make_ring(1, dtype)
    for i in range(x.shape[1]):
        ring = ring.grown(i)
        expected = t(x[:, i : i + 1], caches)[:, 0]
        out, keys, values, position = compiled(x[:, i], ring.keys, ring.values, ring.position)
        ring = KVRing(keys, values, position, config.context)
        assert mx.array_equal(out, expected).item(), i
    assert ring.capacity == config.context and ring.position.item() == x.shape[1]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rounded_sum_is_the_half_type_sum(dtype):
    """The widened residual sum rounds to what a sum in `dtype` gives, bit for bit, eager and
    compiled, over magnitudes 2^-30..2^30 apart and both signs."""
    mx.random.seed(2)
    scale = 2.0 ** mx.random.randint(-15, 15, (2, 4096))
    a, b = (mx.random.normal((2, 4096)) * scale).astype(dtype)
    expected = a + b
    compiled = mx.compile(lambda wide, delta: rounded_sum(wide, delta, dtype))
    for got in (rounded_sum(a.astype(mx.float32), b, dtype), compiled(a.astype(mx.float32), b)):
        assert got.dtype == dtype and mx.array_equal(got, expected).item()


def test_rms_norm_reads_a_float32_copy_of_its_weight():
    """After `transpose_weights` a bf16 norm reads a float32 copy of its weight holding the
    same values (made once, not cast per call), and its outputs are unchanged; a replaced
    weight is read (and cast) again."""
    mx.random.seed(3)
    norm = RMSNorm(64, 1e-8)
    norm.weight = mx.random.normal((64,)).astype(mx.bfloat16)
    x = mx.random.normal((2, 64)).astype(mx.bfloat16)
    before = norm(x)
    mx.eval(transpose_weights(norm))
    widened = norm.float32_weight.view
    assert widened.dtype == mx.float32
    assert mx.array_equal(widened, norm.weight.astype(mx.float32)).item()
    assert mx.array_equal(widened.astype(mx.bfloat16), norm.weight).item()
    assert mx.array_equal(norm(x), before).item() and norm(x).dtype == mx.bfloat16
    norm.weight = 2 * norm.weight
    assert mx.array_equal(norm(x), RMSNorm.__call__(norm, x)).item()
    assert not mx.array_equal(norm(x), before).item()


def _plain_bf16_layers(t: Transformer, x: mx.array, caches: list, cross: list) -> mx.array:
    """The layers' residual sums in the activations' dtype, each norm casting its input: the
    arithmetic the widened stream must reproduce."""
    for layer, cache, layer_cross in zip(t.layers, caches, cross):
        x = x + layer.self_attn(layer.norm1(x), cache.make_mask(x.shape[1]), cache)
        x = x + layer.cross_attention(layer.norm_cross(x), layer_cross)
        x = x + layer._feed_forward(layer.norm2(x))
    return x


def test_widened_step_equals_layer_calls_with_cross_attention():
    """The step's residual stream held in float32 (RMSNorm layers, with cross-attention and
    random norm weights, their float32 copies read) gives the bf16 layers' numbers, bit for
    bit, compiled, over several positions."""
    config = TransformerConfig(64, 4, 2, 96, context=8, cross_attention=True)
    mx.random.seed(4)
    t = Transformer(config)
    for layer in t.layers:
        for norm in (layer.norm1, layer.norm2):
            norm.weight = 1 + 0.3 * mx.random.normal((config.d_model,))
    t.set_dtype(mx.bfloat16)
    cross = t.cross_keys_values(mx.random.normal((1, 5, config.d_model)).astype(mx.bfloat16))
    x = (4 * mx.random.normal((1, 6, config.d_model))).astype(mx.bfloat16)
    mx.eval(transpose_weights(t), cross)

    def step(x, keys, values, position):
        ring = KVRing(keys, values, position, config.context)
        out, ring = t(x, ring.layers(), cross), ring.advanced()
        return out, ring.keys, ring.values, ring.position

    compiled = mx.compile(step)
    caches, ring = t.make_caches(), t.make_ring(1, mx.bfloat16).grown(x.shape[1])
    for i in range(x.shape[1]):
        expected = _plain_bf16_layers(t, x[:, i : i + 1], caches, cross)[:, 0]
        out, keys, values, position = compiled(x[:, i], ring.keys, ring.values, ring.position)
        ring = KVRing(keys, values, position, config.context)
        assert out.dtype == mx.bfloat16 and mx.array_equal(out, expected).item(), i


@pytest.mark.parametrize("quantized", [False, True])
def test_cross_attention_reads_its_query_rows_made_once(quantized):
    """After `transpose_weights` the cross-attention's queries read the query rows of its
    packed `in_proj` made once (transposed; a quantized one's packed rows, scales and
    biases), with the same outputs; a replaced `in_proj` is read again."""
    config = TransformerConfig(64, 4, 1, 96, context=4, cross_attention=True)
    mx.random.seed(7)
    attention = CrossAttention(config)
    attention.set_dtype(mx.bfloat16)
    if quantized:
        nn.quantize(attention, group_size=32, bits=8)
    source = mx.random.normal((1, 5, config.d_model)).astype(mx.bfloat16)
    x = mx.random.normal((1, config.d_model)).astype(mx.bfloat16)
    cross = attention.keys_values(source)
    before = attention(x, cross)
    mx.eval(transpose_weights(attention))
    assert isinstance(attention.query_weight.view, dict) == quantized  # rows, or transposed
    assert isinstance(attention.query_weight.view, mx.array) != quantized
    assert mx.array_equal(attention(x, cross), before).item()
    attention.in_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
    assert not mx.array_equal(attention(x, cross), before).item()
