"""The Moshi family's language model: Helium temporal transformer, text head and depformer.

At each 80 ms step the temporal transformer reads one text token and the audio tokens (Moshi's
8 codebooks then the user's 8), predicts the next text token, and hands its output to the
depformer (`moshi_mlx.models.depformer`), which predicts Moshi's 8 audio codebooks. Kyutai's
speech-to-text has no depformer (`dep_q` 0): 32 audio streams in, the text and its
voice-activity heads (`extra_heads`) out. Hibiki adds a condition vector
(`moshi_mlx.models.conditioners`) to every step's input. Kyutai's TTS adds one too, and its
temporal layers cross-attend to speaker embeddings; its text stream packs two tokens per step
(`moshi_mlx.modules.embeddings`) and its depformer's 32 slices share 11 sets of weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
from mlx import nn

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.conditioners import ConditionProvider
from moshi_mlx.models.config import NORM_EPS, LmConfig
from moshi_mlx.models.depformer import Depformer, zero_no_input
from moshi_mlx.modules.embeddings import StackedTables, make_embedding
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.linear import Linear, StackedLinears
from moshi_mlx.modules.transformer import CrossKV, RMSNorm, Transformer


class Lm(nn.Module):
    """Moshi's LM. Parameter names equal Kyutai's MLX checkpoints (`moshiko_mlx_*.tsv`).

    The depformer has the slices inference samples (`LmConfig.moshi_codebooks`), or with
    `full_depformer` all `dep_q` of the checkpoint (PersonaPlex's 8 more predict the user's
    codebooks: for scoring and for converting files whole).
    """

    def __init__(self, config: LmConfig, full_depformer: bool = False):
        super().__init__()
        self.config = config
        # id text_card: the start token
        self.text_emb = make_embedding(
            config.text_card + 1, config.dim, demux=config.demux_second_stream
        )
        self.audio_embs = [nn.Embedding(config.card + 1, config.dim) for _ in range(config.n_q)]
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.stacked_tables: StackedTables | None = None
        self.transformer = Transformer(config.temporal_config())
        self.out_norm = RMSNorm(config.dim, NORM_EPS[config.norm])
        self.text_linear = Linear(config.dim, config.text_vocab_out, bias=False)
        self.extra_heads = [
            Linear(config.dim, config.extra_heads_dim, bias=False)
            for _ in range(config.extra_heads_num_heads)
        ]
        # Not a parameter: set by `transpose_weight` (`transpose_weights`), never saved.
        self.stacked_heads: StackedLinears | None = None
        if config.dep_q:
            self.depformer = Depformer(config, config.dep_q if full_depformer else None)
        if config.conditioners:
            self.condition_provider = ConditionProvider(
                config.conditioners, config.fuser, config.dim
            )

    def condition(self, conditions: Sequence[Mapping[str, str | None]]) -> mx.array:
        """The condition vector (B, dim) that `step_text` adds to each input, for each batch
        row's values (conditioner name -> value, e.g. Hibiki's {"description": "very_good"};
        None: absent)."""
        if not self.config.fuser.sum:
            raise ConfigError("this model takes no conditions")
        return self.condition_provider.sum(conditions)

    def cross_keys_values(self, tensors: Mapping[str, tuple[mx.array, mx.array]]) -> list[CrossKV]:
        """Each temporal layer's cross-attention keys and values for the cross conditions
        (name -> (tensor (B, T, dim), mask (B, T) bool), e.g. the TTS's "speaker_wavs")."""
        if not self.config.cross_attention:
            raise ConfigError("this model takes no cross-attended conditions")
        source = self.condition_provider.cross_source(tensors)
        return self.transformer.cross_keys_values(source.astype(self.out_norm.weight.dtype))

    def make_ring(self, batch: int = 1, quantization: KVQuantization | None = None) -> KVRing:
        """Fresh streaming state of the temporal transformer for `step_text`, its keys and
        values optionally quantized (the head dimension must divide by the group size)."""
        # The keys' dtype is what the first projection yields (built lazily, never evaluated).
        probe = self.transformer.layers[0].self_attn.in_proj(self.text_emb(mx.array([0])))
        if quantization is not None:
            quantization.check_head_dim(self.transformer.config.head_dim)
        return self.transformer.make_ring(batch, probe.dtype, quantization)

    def embed(self, tokens: mx.array) -> mx.array:
        """Sum of the text and audio embeddings; tokens (B, n_q + 1, T) -> (B, T, dim),
        one position's (B, n_q + 1) -> (B, dim), or one row's (n_q + 1,) -> (1, dim).

        Token -1 stands for "no input" and contributes a zero vector.
        """
        stacked = self.stacked_tables
        if stacked is not None and stacked.holds(self.tables):  # one lookup of every stream
            if tokens.ndim == 1:  # no expansion of the tokens, no squeeze of the sum
                return stacked(tokens).sum(axis=0, keepdims=True)
            return stacked(tokens).sum(axis=1)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if stacked is not None and stacked.holds(self.audio_embs):  # the text's table apart
            text, audio = mx.split(tokens, [1], axis=1)
            text_vectors = zero_no_input(text, self.text_emb(mx.maximum(text, 0)))
            return mx.concatenate([text_vectors, stacked(audio)], axis=1).sum(axis=1)
        # One split into (B, 1, ...) streams, each looked up as (B, 1, ..., dim).
        streams = mx.split(mx.maximum(tokens, 0), len(self.tables), axis=1)
        embs = mx.concatenate([table(ids) for table, ids in zip(self.tables, streams)], axis=1)
        return zero_no_input(tokens, embs).sum(axis=1)

    @property
    def tables(self) -> list[nn.Module]:
        """The input streams' tables: the text's, then the audio codebooks'."""
        return [self.text_emb, *self.audio_embs]

    def transpose_weight(self) -> list[mx.array]:
        """`transpose_weights`' hook for the LM itself: stack the input streams' tables
        (`stacked_tables`, `StackedTables`; the audio tables alone where the text's does not
        stack with them, e.g. the TTS's two-stream one) and the extra heads (`stacked_heads`,
        `StackedLinears`: one product) unless they still are; the stacks' arrays, for the
        caller to evaluate (none: tables that do not stack, looked up one by one)."""
        stacked = self.stacked_tables
        if stacked is None or not (stacked.holds(self.tables) or stacked.holds(self.audio_embs)):
            stacked = StackedTables.of(self.tables) or StackedTables.of(self.audio_embs)
            self.stacked_tables = stacked
        heads = self.stacked_heads
        if self.extra_heads and (heads is None or not heads.holds(self.extra_heads)):
            heads = self.stacked_heads = StackedLinears.of(self.extra_heads)
        arrays = [] if stacked is None else list(stacked.flat.values())
        return arrays + ([] if heads is None else heads.arrays)

    def prefill(self, embeddings: mx.array, ring: KVRing) -> KVRing:
        """The temporal transformer over the first T inputs at once, given as their summed
        embeddings (B, T, dim) (`embed`), from a `KVRing` at position 0: the ring as T
        `step_text`s leave it (lazily; T must be less than the context, the ring's capacity
        is grown to fit)."""
        steps = embeddings.shape[1]
        if steps >= self.transformer.config.context:
            raise ValueError(f"a prefill of {steps} positions exceeds the context")
        ring = ring.grown(steps)
        ring = ring.replaced(ring.keys, ring.values, ring.position)  # its own buffer lists
        self.transformer(embeddings, ring.layers())
        return ring.replaced(ring.keys, ring.values, ring.position + steps)

    def head_probabilities(self, temporal_out: mx.array) -> mx.array:
        """The extra heads' class probabilities of a normed temporal output (B, dim) ->
        (B, extra_heads_num_heads, extra_heads_dim) (STT: voice activity)."""
        stacked, heads = self.stacked_heads, self.extra_heads
        if stacked is not None and stacked.holds(heads) and stacked.exact_for(temporal_out):
            # One product, read as (B, heads, dim).
            logits = stacked.product(temporal_out).reshape(temporal_out.shape[0], len(heads), -1)
        else:
            logits = mx.stack([head(temporal_out) for head in heads], axis=1)
        return mx.softmax(logits.astype(mx.float32), axis=-1)

    def step_text(
        self,
        tokens: mx.array,
        ring: KVRing,
        condition: mx.array | None = None,
        cross: list[CrossKV] | None = None,
    ) -> tuple[mx.array, mx.array]:
        """The temporal transformer on one position through a `KVRing`, in
        `mx.compile`-able form: tokens (B, n_q + 1) (or (B, n_q + 1, 1), or one row's
        (n_q + 1,): B = 1) -> the normed output (B, dim), which conditions the depformer, and
        the text logits (B, text_vocab_out).
        A conditioned model's `condition` (B, dim) is added to the input; a cross-attending
        one attends to `cross` (`cross_keys_values`).
        """
        x = self.embed(tokens)
        if x.ndim == 3:
            x = x.reshape(x.shape[0], -1)
        if condition is not None:
            x = x + condition.astype(x.dtype)
        x = self.out_norm(self.transformer(x, ring.layers(), cross))
        return x, self.text_linear(x)
