"""The streaming transformer shared by Helium, the depformer and Mimi.

Helium and the depformer use RMSNorm and a gated SiLU feed-forward; Mimi uses LayerNorm, a
GELU feed-forward and layer scale. Attention is causal over a window of `context` positions,
with interleaved ("traditional", "rope") or split-halves ("rope_concat", Hibiki-Zero) RoPE as
in Kyutai's reference, or no positional embedding; with `kv_repeat` > 1 each key/value head
serves that many query heads (grouped-query attention: the caches hold the fewer heads).
The TTS's temporal layers also attend, after self-attention, to a fixed sequence (its
speaker embeddings) through a LayerNorm'd cross-attention without positions or mask, whose
keys and values are computed once per sequence (`Transformer.cross_keys_values`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
from mlx import nn

from moshi_mlx.modules.kv_cache import Buffer, KVCache, KVRing, LayerCache, Mask
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.linear import Linear
from moshi_mlx.modules.step_tricks import (
    QUANTIZED_PARTS,
    RopeTables,
    StepWeight,
    rope_tables,
    rounded_sum,
)


@dataclass(frozen=True)
class TransformerConfig:
    d_model: int
    num_heads: int
    num_layers: int
    ffn_hidden: int  # width of the feed-forward hidden layer (one branch, for gated FFNs)
    context: int  # each query attends to this many positions, itself included
    norm: Literal["rms_norm", "layer_norm"] = "rms_norm"
    norm_eps: float = 1e-8
    gated: bool = True  # gated SiLU (Helium) or plain GELU (Mimi) feed-forward
    positional_embedding: Literal["rope", "rope_concat", "none"] = "rope"
    max_period: float = 10_000.0
    layer_scale: float | None = None
    cross_attention: bool = False
    kv_repeat: int = 1  # query heads per key/value head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads // self.kv_repeat

    @property
    def rope_interleaved(self) -> bool:
        """Whether RoPE rotates adjacent pairs ("rope"), not the two halves ("rope_concat")."""
        return self.positional_embedding == "rope"


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, whatever the activations' dtype. A step reads the weight
    as a float32 copy made once (`transpose_weight`, the same values: a bf16 weight widened),
    not cast on every call: on a GPU, where the norm is one kernel, each cast is one more."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.float32_weight: StepWeight | None = None

    def transpose_weight(self) -> mx.array:
        """Make (or keep) `float32_weight`, the current weight widened to float32 (itself when
        float32 already), for the caller to evaluate."""
        self.float32_weight = StepWeight.kept(
            self.float32_weight, self.weight, lambda weight: weight.astype(mx.float32)
        )
        return self.float32_weight.view

    def __call__(self, x: mx.array, dtype: mx.Dtype | None = None) -> mx.array:
        """x normed, in `dtype` (default: x's; x may be a float32 widening of it)."""
        weight = StepWeight.current(self.float32_weight, self.weight)
        if weight is None:
            weight = self.weight.astype(mx.float32)
        out = mx.fast.rms_norm(x.astype(mx.float32), weight, self.eps)
        return out.astype(dtype or x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dims: int, init: float):
        super().__init__()
        self.scale = mx.full((dims,), init)

    def __call__(self, x: mx.array) -> mx.array:
        return x * self.scale


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.use_rope = config.positional_embedding != "none"
        self.interleaved = config.rope_interleaved
        self.max_period = config.max_period
        # Rows: the queries, then the keys and the values of the num_kv_heads heads.
        kv_dim = 2 * config.num_kv_heads * config.head_dim
        self.in_proj = Linear(config.d_model, config.d_model + kv_dim, bias=False)
        self.out_proj = Linear(config.d_model, config.d_model, bias=False)

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(
            x,
            self.head_dim,
            traditional=self.interleaved,
            base=self.max_period,
            scale=1.0,
            offset=offset,
        )

    def _project(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, ...]:
        """Queries (B, H, T, head_dim), keys and values (B, H_kv, T, head_dim) of x (B, T, D),
        RoPE from `offset`."""
        batch, steps, _ = x.shape
        qkv = self.in_proj(x)
        if self.num_kv_heads == self.num_heads:
            qkv = qkv.reshape(batch, steps, 3, self.num_heads, self.head_dim)
            qkv = qkv.transpose(2, 0, 3, 1, 4)  # (3, B, H, T, head_dim)
            queries, keys, values = qkv[0], qkv[1], qkv[2]
        else:
            heads = self.num_heads + 2 * self.num_kv_heads
            qkv = qkv.reshape(batch, steps, heads, self.head_dim).transpose(0, 2, 1, 3)
            queries, keys, values = mx.split(qkv, self._kv_splits(), axis=1)
        if self.use_rope:
            queries = self._rope(queries, offset)
            keys = self._rope(keys, offset)
        return queries, keys, values

    def _project_one(self, x: mx.array, rope: RopeTables | None) -> tuple[mx.array, ...]:
        """Queries, keys and values (B, H or H_kv, 1, head_dim) of one position x (B, D),
        RoPE'd with a step's `rope_tables`: no transposes of a single position."""
        qkv = self.in_proj(x)  # (B, (H + 2 H_kv) head_dim)
        if self.use_rope:
            # Pairs (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin): adjacent (interleaved)
            # or i and i + half (split halves), each feature's partner gathered.
            cos, sin, partners = rope
            qkv = qkv * cos + mx.take_along_axis(qkv, partners, axis=1) * sin
        qkv = qkv.reshape(x.shape[0], self.num_heads + 2 * self.num_kv_heads, 1, self.head_dim)
        return mx.split(qkv, self._kv_splits(), axis=1)

    def _kv_splits(self) -> list[int]:
        """Where the keys' and the values' heads start among the projection's heads."""
        return [self.num_heads, self.num_heads + self.num_kv_heads]

    def __call__(
        self, x: mx.array, mask: Mask, cache: LayerCache, rope: RopeTables | None = None
    ) -> mx.array:
        """x (B, T, D) -> (B, T, D), attending through `cache` (`LayerCache`), which takes
        the new keys and values and returns what to attend to under `mask`; RoPE from the
        cache's offset. One position x (B, D) of a compiled step takes the step's
        `rope_tables` instead, shared by every layer, which also scale its queries."""
        if x.ndim == 2:
            queries, keys, values = self._project_one(x, rope)
        else:
            queries, keys, values = self._project(x, cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        # One RoPE'd position's queries come scaled (`rope_tables`' query scale).
        scale = None if x.ndim == 2 and self.use_rope else self.scale
        out = scaled_dot_product_attention(queries, keys, values, cache, scale, mask)
        if x.ndim == 2:
            return self.out_proj(out.reshape(x.shape[0], -1))
        batch, _, steps, _ = queries.shape
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(batch, steps, -1))


def fused_attention(array_mask: bool) -> bool:
    """Whether MLX runs `mx.fast`'s attention of one query as one kernel rather than as the
    operations it decomposes it into (the queries' scaling, the keys' transpose, two
    products, the mask's `where` and a softmax): on a GPU, and under an array mask
    (`array_mask`) only on Metal, whose vector kernel takes one (MLX 0.32's CUDA kernels take
    none). Attention picks its form by it."""
    if mx.default_device() != mx.gpu:
        return False
    return not array_mask or mx.metal.is_available()


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Buffer,
    values: Buffer,
    cache: LayerCache,
    scale: float | None,
    mask: Mask,
) -> mx.array:
    """Attention over what a cache returned: packed through its quantization's attention
    when the buffers are a quantized ring's, else MLX's fused attention. `scale` None: the
    queries come scaled, and where MLX would decompose attention (`fused_attention`) it is
    MLX's decomposition less the scaling, the same operations on the same values. Grouped
    queries (more heads than the keys) attend there as `rep` rows of one key head each; on a
    GPU they keep MLX's own attention."""
    heads, kv_heads = queries.shape[1], (keys[0] if isinstance(keys, tuple) else keys).shape[1]
    quantized, on_gpu = isinstance(keys, tuple), fused_attention(array_mask=False)
    if heads != kv_heads and (quantized or (scale is None and not on_gpu)):
        batch, _, steps, head_dim = queries.shape
        rep = heads // kv_heads
        grouped = queries.reshape(batch, kv_heads, rep * steps, head_dim)
        if isinstance(mask, mx.array) and mask.ndim >= 2:  # rows (r, t): mask row t each
            mask = mx.tile(mask, (rep, 1))
        out = scaled_dot_product_attention(grouped, keys, values, cache, scale, mask)
        return out.reshape(batch, heads, steps, head_dim)
    one_position = not quantized and mask is None and keys.shape[2] == 1 == queries.shape[2]
    if heads == kv_heads and one_position:
        return values  # one query, one position (a depformer's first): weight exactly 1
    array_mask = isinstance(mask, mx.array) and heads == kv_heads
    if scale is None and not quantized and not fused_attention(array_mask):
        scores = queries @ keys.swapaxes(-1, -2)
        if mask is not None:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        return mx.softmax(scores, axis=-1, precise=True) @ values
    scale = 1.0 if scale is None else scale
    if quantized:
        return cache.quantization.attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


QuantizedRows = dict[str, mx.array]  # a quantized linear's packed rows, scales and biases


def quantized_rows(linear: nn.QuantizedLinear, start: int, stop: int) -> QuantizedRows:
    """Output features start..stop-1 of a `QuantizedLinear`: its packed rows, scales and
    biases (views)."""
    return {name: linear[name][start:stop] for name in QUANTIZED_PARTS if name in linear}


def rows_of(
    linear: nn.Module, x: mx.array, start: int, stop: int, rows: QuantizedRows | None = None
) -> mx.array:
    """Output features start..stop-1 of a `Linear` or `QuantizedLinear` (no bias) on x; of a
    quantized one read from `rows` when given (its `quantized_rows` start..stop-1)."""
    if isinstance(linear, nn.QuantizedLinear):
        rows = rows or quantized_rows(linear, start, stop)
        return mx.quantized_matmul(
            x,
            rows["weight"],
            scales=rows["scales"],
            biases=rows.get("biases"),
            transpose=True,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return x @ linear.weight[start:stop].T


CrossKV = tuple[mx.array, mx.array]  # a layer's cross-attention keys and values (B, H, S, hd)


class CrossAttention(nn.Module):
    """Attention of each position to a fixed source sequence: queries from the first third of
    `in_proj`, keys and values from the rest (Kyutai's packed layout)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.d_model = config.d_model
        self.scale = config.head_dim**-0.5
        self.in_proj = Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out_proj = Linear(config.d_model, config.d_model, bias=False)
        # Not a parameter: the query rows of `in_proj` as a step reads them, made once
        # (`transpose_weight`): transposed, or a quantized one's `quantized_rows`.
        self.query_weight: StepWeight | None = None

    def transpose_weight(self) -> mx.array | list[mx.array]:
        """Make (or keep) `query_weight`, the transposed view of the query rows of the
        current `in_proj` weight, or a quantized one's `quantized_rows`; for the caller to
        evaluate."""
        made = StepWeight.kept(self.query_weight, self.in_proj.weight, self._query_rows)
        self.query_weight = made
        return list(made.view.values()) if isinstance(made.view, dict) else made.view

    def _query_rows(self, weight: mx.array) -> mx.array | QuantizedRows:
        """The query rows of `in_proj` (whose weight is `weight`) as a step reads them."""
        if isinstance(self.in_proj, nn.QuantizedLinear):
            return quantized_rows(self.in_proj, 0, self.d_model)
        return weight[: self.d_model].T

    def _queries(self, x: mx.array) -> mx.array:
        view = StepWeight.current(self.query_weight, self.in_proj.get("weight"))
        if isinstance(view, mx.array):
            return x @ view
        return rows_of(self.in_proj, x, 0, self.d_model, view)

    def keys_values(self, source: mx.array) -> CrossKV:
        """source (B, S, D) -> keys and values (B, H, S, head_dim)."""
        batch, length, dim = source.shape
        kv = rows_of(self.in_proj, source, dim, 3 * dim)
        kv = kv.reshape(batch, length, 2, self.num_heads, -1).transpose(2, 0, 3, 1, 4)
        return kv[0], kv[1]

    def __call__(self, x: mx.array, cross: CrossKV) -> mx.array:
        """x (B, T, D) or one position (B, D) -> the same shape."""
        shape, heads = x.shape, self.num_heads
        queries = self._queries(x)
        if x.ndim == 2:  # one position: (B, H, 1, head_dim) is a reshape, no transposes
            queries = queries.reshape(shape[0], heads, 1, -1)
            out = mx.fast.scaled_dot_product_attention(queries, *cross, scale=self.scale)
            return self.out_proj(out.reshape(shape))
        queries = queries.reshape(shape[0], -1, heads, self.d_model // heads)
        out = mx.fast.scaled_dot_product_attention(
            queries.transpose(0, 2, 1, 3), *cross, scale=self.scale
        )
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(shape))


class GatedFeedForward(nn.Module):
    """SiLU(x W_gate) * (x W_up), with gate and up projections fused in `linear_in`."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.linear_in = Linear(d_model, 2 * hidden, bias=False)
        self.linear_out = Linear(hidden, d_model, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.linear_in(x), 2, axis=-1)
        return self.linear_out(nn.silu(gate) * up)


class TransformerLayer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.norm == "rms_norm":
            self.norm1 = RMSNorm(config.d_model, config.norm_eps)
            self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        else:
            self.norm1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
            self.norm2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.gated = config.gated
        if config.gated:
            self.gating = GatedFeedForward(config.d_model, config.ffn_hidden)
        else:
            self.linear1 = Linear(config.d_model, config.ffn_hidden, bias=False)
            self.linear2 = Linear(config.ffn_hidden, config.d_model, bias=False)
        self.has_layer_scale = config.layer_scale is not None
        if config.layer_scale is not None:
            self.layer_scale_1 = LayerScale(config.d_model, config.layer_scale)
            self.layer_scale_2 = LayerScale(config.d_model, config.layer_scale)
        if config.cross_attention:  # always a LayerNorm, as in Kyutai's reference
            self.norm_cross = nn.LayerNorm(config.d_model, eps=1e-5)
            self.cross_attention = CrossAttention(config)

    def _feed_forward(self, x: mx.array) -> mx.array:
        if self.gated:
            return self.gating(x)
        return self.linear2(nn.gelu(self.linear1(x)))

    @property
    def widened(self) -> bool:
        """Whether this layer's residual stream is held widened to float32 (RMSNorm layers
        without layer scale: Helium's and the depformer's), else in the activations' dtype
        (Mimi's LayerNorm layers with layer scale)."""
        return isinstance(self.norm1, RMSNorm) and not self.has_layer_scale

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: LayerCache,
        cross: CrossKV | None = None,
        rope: RopeTables | None = None,
        dtype: mx.Dtype | None = None,
    ) -> mx.array:
        """x (B, T, D), or one position (B, D), through this layer (see `Attention`). A
        `widened` layer takes and returns its residual stream in float32 holding values of
        `dtype`, the activations' dtype (default: x's): the numbers `dtype` arithmetic gives, each norm's
        input cast fused into the residual sum before it (`rounded_sum`)."""
        if not self.widened:
            return self._residuals(x, self.self_attn(self.norm1(x), mask, cache, rope), cross)
        dtype = dtype or x.dtype
        attended = self.self_attn(self.norm1(x, dtype), mask, cache, rope)
        x = rounded_sum(x, attended, dtype)
        if cross is not None:
            attended = self.cross_attention(self.norm_cross(x), cross)
            x = rounded_sum(x.astype(mx.float32), attended, dtype)
        wide = x.astype(mx.float32)
        out = rounded_sum(wide, self._feed_forward(self.norm2(wide, dtype)), dtype)
        return out.astype(mx.float32)

    def _residuals(self, x: mx.array, attn: mx.array, cross: CrossKV | None) -> mx.array:
        if self.has_layer_scale:
            attn = self.layer_scale_1(attn)
        x = x + attn
        if cross is not None:
            x = x + self.cross_attention(self.norm_cross(x), cross)
        ff = self._feed_forward(self.norm2(x))
        if self.has_layer_scale:
            ff = self.layer_scale_2(ff)
        return x + ff


class Transformer(nn.Module):
    """A stack of `TransformerLayer`s; the caller owns the streaming state: one
    `LayerCache` per layer (mlx-lm's protocol: Mimi's `KVCache`s, a `KVRing`'s or a
    `StepKV`'s `layers()`)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = [TransformerLayer(config) for _ in range(config.num_layers)]

    def make_caches(self) -> list[KVCache]:
        """Fresh streaming state: one `KVCache` per layer (Mimi's)."""
        return [KVCache(self.config.context) for _ in self.layers]

    def make_ring(
        self, batch: int, dtype: mx.Dtype, quantization: KVQuantization | None = None
    ) -> KVRing:
        """Fresh streaming state for compiled steps; `dtype` is the activations' (and
        keys') dtype."""
        config = self.config
        shape = (batch, config.num_kv_heads, config.head_dim)
        return KVRing.empty(config.num_layers, shape, dtype, config.context, quantization)

    def cross_keys_values(self, source: mx.array) -> list[CrossKV]:
        """Each layer's cross-attention keys and values of a source sequence (B, S, D)."""
        return [layer.cross_attention.keys_values(source) for layer in self.layers]

    def __call__(
        self,
        x: mx.array,
        caches: Sequence[LayerCache],
        cross: list[CrossKV] | None = None,
    ) -> mx.array:
        """x (B, T, D), or one position x (B, D) of a compiled step, through every layer,
        layer i attending through `caches[i]` under the mask the first cache makes (mlx-lm's
        `make_mask`). One position is RoPE'd with the step's `rope_tables` (at the first
        cache's offset), shared by every layer."""
        config, first = self.config, caches[0]
        mask = first.make_mask(1 if x.ndim == 2 else x.shape[1])
        rope = None
        if x.ndim == 2 and config.positional_embedding != "none":
            rope = rope_tables(
                first.offset,
                config.head_dim,
                config.max_period,
                first.dtype,
                (config.num_heads, config.num_kv_heads),
                config.head_dim**-0.5,
                config.rope_interleaved,
            )
        dtype = x.dtype
        widened = self.layers[0].widened
        if widened:
            x = x.astype(mx.float32)
        for index, (layer, cache) in enumerate(zip(self.layers, caches)):
            x = layer(x, mask, cache, None if cross is None else cross[index], rope, dtype)
        return x.astype(dtype) if widened else x
