"""The Moshi language model: Helium temporal transformer, text head and depformer.

At each 80 ms step the temporal transformer reads one text token and 16 audio tokens (Moshi's
8 codebooks then the user's 8), predicts the next text token, and hands its output to the
depformer (`moshi_mlx.models.depformer`), which predicts Moshi's 8 audio codebooks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import mlx.core as mx
from mlx import nn

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.depformer import Depformer, zero_no_input
from moshi_mlx.modules.kv_cache import KVCache, KVRing
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.transformer import RMSNorm, Transformer, TransformerConfig

MOSHI_DELAYS = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
_NORM_EPS = {"rms_norm_f32": 1e-8, "rms_norm": 1e-5}
_POSITIONAL = ("rope", "none")
_GENERATORS = ("moshi", "personaplex")

# Keys of Kyutai's config.json that change the architecture in ways this model does not
# implement, with the only value accepted for each.
_FIXED_KEYS: dict[str, Any] = {
    "causal": True,
    "layer_scale": None,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "depformer_weights_per_step_schedule": None,
    "depformer_low_rank_embeddings": None,
    "depformer_norm": None,
    "demux_second_stream": False,
    "demux_second_text_stream": False,
    "cross_attention": False,
    "conditioners": None,
    "fuser": None,
    "norm_emb": False,
    "bias_proj": False,
    "bias_ff": False,
    "bias_attn": False,
    "kv_repeat": 1,
    "extra_heads_num_heads": 0,
    "text_card_out": None,
    "depformer_gating": "silu",
}
# The fixed keys written out by `to_dict`, as the reference's defaults differ from Moshi's.
_WRITTEN_FIXED_KEYS = (
    "causal",
    "layer_scale",
    "depformer_layer_scale",
    "depformer_multi_linear",
    "depformer_weights_per_step",
    "depformer_gating",
)
_REQUIRED_KEYS = ("dim", "num_heads", "num_layers", "card", "text_card", "n_q", "dep_q", "delays")


def gated_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of a gated FFN, by the reference's rule for `dim_feedforward`."""
    if dim_feedforward == 4 * dim:
        return 21 * dim // 8
    return 2 * dim_feedforward // 3


@dataclass(frozen=True)
class LmConfig:
    """Architecture of a Moshi LM, in the terms of Kyutai's `config.json`."""

    dim: int
    num_heads: int
    num_layers: int
    hidden_scale: float
    context: int
    depformer_dim: int
    depformer_num_heads: int
    depformer_num_layers: int
    depformer_dim_feedforward: int
    card: int
    text_card: int
    n_q: int
    dep_q: int
    delays: tuple[int, ...]
    max_period: float = 10_000.0
    positional_embedding: str = "rope"
    norm: str = "rms_norm_f32"
    gating: str = "silu"
    depformer_context: int = 8
    depformer_max_period: float = 10_000.0
    depformer_pos_emb: str = "none"
    existing_text_padding_id: int = 3
    # PersonaPlex's layout: its depformer also predicts the user's codebooks (dep_q = n_q),
    # which inference never samples; None: the audio streams past Moshi's dep_q are the
    # user's. Not a key of Kyutai's config.json (ours writes it when set).
    user_codebooks: int | None = None
    # How conversations run: "moshi" (Kyutai's LMGen) or "personaplex" (NVIDIA's: voice and
    # role prompts first, and each user frame fed one step later). Ours, like user_codebooks.
    generator: str = "moshi"
    moshi_name: str = "model.safetensors"
    mimi_name: str = "tokenizer-e351c8d8-checkpoint125.safetensors"
    tokenizer_name: str = "tokenizer_spm_32k_3.model"

    def __post_init__(self) -> None:
        object.__setattr__(self, "delays", tuple(int(d) for d in self.delays))
        self.validate()

    # Presets ----------------------------------------------------------------------------
    @classmethod
    def moshi_7b(cls) -> LmConfig:
        """Moshi 7B v0.1, as published in kyutai/moshiko-* and kyutai/moshika-*."""
        return cls(
            dim=4096,
            num_heads=32,
            num_layers=32,
            hidden_scale=4.125,
            context=3000,
            depformer_dim=1024,
            depformer_num_heads=16,
            depformer_num_layers=6,
            depformer_dim_feedforward=int(4.125 * 1024),
            card=2048,
            text_card=32000,
            n_q=16,
            dep_q=8,
            delays=MOSHI_DELAYS,
        )

    @classmethod
    def personaplex_7b(cls) -> LmConfig:
        """NVIDIA's PersonaPlex 7B (nvidia/personaplex-7b-v1): Moshi 7B whose depformer has 16
        slices, 8 for Moshi's codebooks and 8 for the user's, with voice and role prompts."""
        return replace(cls.moshi_7b(), dep_q=16, user_codebooks=8, generator="personaplex")

    @classmethod
    def tiny(cls) -> LmConfig:
        """A few-hundred-thousand-parameter model with Moshi's streams, for tests."""
        return cls(
            dim=64,
            num_heads=4,
            num_layers=2,
            hidden_scale=3.0,
            context=16,
            depformer_dim=64,
            depformer_num_heads=4,
            depformer_num_layers=2,
            depformer_dim_feedforward=96,
            card=64,
            text_card=100,
            n_q=16,
            dep_q=8,
            delays=MOSHI_DELAYS,
        )

    # Kyutai's config.json ---------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LmConfig:
        """Read Kyutai's `config.json` keys; unknown keys that do not matter are ignored."""
        missing = [key for key in _REQUIRED_KEYS if key not in data]
        if missing:
            raise ConfigError(f"LM config is missing key(s): {', '.join(missing)}")
        for key, accepted in _FIXED_KEYS.items():
            value = data.get(key, accepted)
            if value != accepted and not (accepted is None and not value):
                raise ConfigError(
                    f"LM config key {key!r} = {value!r} is not supported (expected {accepted!r})"
                )
        known = {f.name for f in fields(cls)}
        kwargs = {key: data[key] for key in known if key in data and data[key] is not None}
        kwargs.setdefault("hidden_scale", 4.125)
        kwargs.setdefault("context", 3000)
        for key in ("depformer_dim", "depformer_num_heads", "depformer_num_layers"):
            if key not in kwargs:
                raise ConfigError(f"LM config is missing key: {key}")
        if "depformer_dim_feedforward" not in kwargs:
            kwargs["depformer_dim_feedforward"] = int(
                kwargs["hidden_scale"] * kwargs["depformer_dim"]
            )
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid LM config: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """This config as Kyutai's `config.json` keys."""
        data = asdict(self)
        data["delays"] = list(self.delays)
        if self.user_codebooks is None:  # our keys, written only where they say something
            del data["user_codebooks"]
        if self.generator == "moshi":
            del data["generator"]
        data.update({key: _FIXED_KEYS[key] for key in _WRITTEN_FIXED_KEYS})
        return data

    def validate(self) -> None:
        """Raise `ConfigError` if the configuration is inconsistent or unsupported."""
        ints = (
            "dim",
            "num_heads",
            "num_layers",
            "context",
            "depformer_dim",
            "depformer_num_heads",
            "depformer_num_layers",
            "depformer_dim_feedforward",
            "card",
            "text_card",
            "n_q",
            "dep_q",
        )
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"LM config {name} must be a positive integer, got {value!r}")
        if len(self.delays) != self.n_q + 1:
            raise ConfigError(
                f"LM config has {len(self.delays)} delays, expected n_q + 1 = {self.n_q + 1}"
            )
        if any(d < 0 for d in self.delays):
            raise ConfigError(f"LM config delays must be >= 0, got {list(self.delays)}")
        if self.dep_q > self.n_q:
            raise ConfigError(f"LM config dep_q = {self.dep_q} exceeds n_q = {self.n_q}")
        if self.user_codebooks is not None and not (
            0 < self.user_codebooks < self.n_q and self.n_q - self.user_codebooks <= self.dep_q
        ):
            raise ConfigError(
                f"LM config user_codebooks = {self.user_codebooks} must leave the depformer's "
                f"dep_q = {self.dep_q} at least the n_q - user_codebooks Moshi codebooks"
            )
        if self.generator not in _GENERATORS:
            raise ConfigError(f"LM config generator must be one of {_GENERATORS}")
        for prefix, dim, heads in (
            ("", self.dim, self.num_heads),
            ("depformer_", self.depformer_dim, self.depformer_num_heads),
        ):
            if dim % heads or (dim // heads) % 2:
                raise ConfigError(
                    f"LM config {prefix}dim = {dim} must split into {heads} heads of even width"
                )
        if self.norm not in _NORM_EPS:
            raise ConfigError(f"LM config norm {self.norm!r} is not one of {sorted(_NORM_EPS)}")
        if self.gating != "silu":
            raise ConfigError(f"LM config gating {self.gating!r} is not supported (only 'silu')")
        for name in ("positional_embedding", "depformer_pos_emb"):
            if getattr(self, name) not in _POSITIONAL:
                raise ConfigError(f"LM config {name} must be one of {_POSITIONAL}")
        if self.hidden_scale <= 0:
            raise ConfigError(f"LM config hidden_scale must be > 0, got {self.hidden_scale}")
        if not 0 <= self.existing_text_padding_id < self.text_card:
            raise ConfigError("LM config existing_text_padding_id must be a text token id")

    # Derived sizes ----------------------------------------------------------------------
    @property
    def num_codebooks(self) -> int:
        """Streams per step: text plus `n_q` audio codebooks."""
        return self.n_q + 1

    @property
    def num_user_codebooks(self) -> int:
        """The user's audio codebooks: the last audio streams (`user_codebooks`, else the
        `n_q` streams past Moshi's `dep_q`)."""
        return self.n_q - self.dep_q if self.user_codebooks is None else self.user_codebooks

    @property
    def moshi_codebooks(self) -> int:
        """Moshi's own audio codebooks: the first audio streams, sampled by the depformer's
        first slices and played (PersonaPlex's later slices predict the user's streams)."""
        return self.n_q - self.num_user_codebooks

    @property
    def prompted(self) -> bool:
        """Whether conversations start with PersonaPlex's voice and role prompts."""
        return self.generator == "personaplex"

    @property
    def attention_window(self) -> int:
        """Positions a temporal step attends to. NVIDIA's KV cache (Kyutai's before it was
        fixed) masks its oldest slot once full, so PersonaPlex was run with `context - 1`."""
        return self.context - 1 if self.generator == "personaplex" else self.context

    @property
    def user_input_lag(self) -> int:
        """Steps a user frame waits beyond its stream's delay: NVIDIA's generator writes each
        frame one step further ahead than Kyutai's (its first call only fills the token ring)."""
        return 1 if self.generator == "personaplex" else 0

    @property
    def start_tokens(self) -> tuple[int, ...]:
        """Each stream's start token, fed while its delay runs: text, then every audio
        codebook; each is its stream's largest id (one past its vocabulary)."""
        return (self.text_card,) + (self.card,) * self.n_q

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def ffn_hidden(self) -> int:
        return gated_hidden(self.dim, int(self.hidden_scale * self.dim))

    @property
    def depformer_ffn_hidden(self) -> int:
        return gated_hidden(self.depformer_dim, self.depformer_dim_feedforward)

    def temporal_config(self) -> TransformerConfig:
        return TransformerConfig(
            d_model=self.dim,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
            ffn_hidden=self.ffn_hidden,
            context=self.attention_window,
            norm_eps=_NORM_EPS[self.norm],
            positional_embedding=self.positional_embedding,
            max_period=self.max_period,
        )

    def depformer_config(self) -> TransformerConfig:
        # The reference sizes the depformer's cache by its dep_q steps, whatever
        # `depformer_context` says: every slice sees all earlier slices of the same step.
        return TransformerConfig(
            d_model=self.depformer_dim,
            num_heads=self.depformer_num_heads,
            num_layers=self.depformer_num_layers,
            ffn_hidden=self.depformer_ffn_hidden,
            context=self.dep_q,
            norm_eps=_NORM_EPS[self.norm],
            positional_embedding=self.depformer_pos_emb,
            max_period=self.depformer_max_period,
        )


class Lm(nn.Module):
    """Moshi's LM. Parameter names equal Kyutai's MLX checkpoints (`moshiko_mlx_*.tsv`).

    The depformer has the slices inference samples (`LmConfig.moshi_codebooks`), or with
    `full_depformer` all `dep_q` of the checkpoint (PersonaPlex's 8 more predict the user's
    codebooks: for scoring and for converting files whole).
    """

    def __init__(self, cfg: LmConfig, full_depformer: bool = False):
        super().__init__()
        self.cfg = cfg
        self.text_emb = nn.Embedding(cfg.text_card + 1, cfg.dim)  # id text_card: start token
        self.audio_embs = [nn.Embedding(cfg.card + 1, cfg.dim) for _ in range(cfg.n_q)]
        self.transformer = Transformer(cfg.temporal_config())
        self.out_norm = RMSNorm(cfg.dim, _NORM_EPS[cfg.norm])
        self.text_linear = nn.Linear(cfg.dim, cfg.text_card, bias=False)
        self.depformer = Depformer(cfg, cfg.dep_q if full_depformer else None)

    def make_caches(self) -> list[KVCache]:
        """Fresh streaming state of the temporal transformer."""
        return self.transformer.make_caches()

    def make_ring(self, batch: int = 1, quantization: KVQuantization | None = None) -> KVRing:
        """Fresh streaming state of the temporal transformer for `step_text`, its keys and
        values optionally quantized (the head dimension must divide by the group size)."""
        # The keys' dtype is what the first projection yields (built lazily, never evaluated).
        probe = self.transformer.layers[0].self_attn.in_proj(self.text_emb(mx.array([0])))
        if quantization is not None:
            quantization.check_head_dim(self.transformer.cfg.head_dim)
        return self.transformer.make_ring(batch, probe.dtype, quantization)

    def embed(self, tokens: mx.array) -> mx.array:
        """Sum of the text and audio embeddings; tokens (B, n_q + 1, T) -> (B, T, dim).

        Token -1 stands for "no input" and contributes a zero vector.
        """
        clamped = mx.maximum(tokens, 0)
        tables = [self.text_emb, *self.audio_embs]
        embs = mx.stack([table(clamped[:, k]) for k, table in enumerate(tables)], axis=1)
        return zero_no_input(tokens, embs).sum(axis=1)

    def forward_text(self, tokens: mx.array, caches: list[KVCache]) -> tuple[mx.array, mx.array]:
        """Run the temporal transformer on tokens (B, n_q + 1, T).

        Returns the normed transformer output (B, T, dim), which conditions the depformer,
        and the text logits (B, T, text_card).
        """
        x = self.transformer(self.embed(tokens), caches)
        x = self.out_norm(x)
        return x, self.text_linear(x)

    def prefill(self, embeddings: mx.array, ring: KVRing) -> KVRing:
        """The temporal transformer over the first T inputs at once, given as their summed
        embeddings (B, T, dim) (`embed`): the `KVRing` as T `step_text`s leave it."""
        return self.transformer.prefill(embeddings, ring)[1]

    def step_text(self, tokens: mx.array, ring: KVRing) -> tuple[mx.array, mx.array]:
        """`forward_text` of one position through a `KVRing`, in `mx.compile`-able form:
        tokens (B, n_q + 1, 1) -> the normed output (B, dim) and the text logits (B, text_card).
        """
        x = self.embed(tokens)
        x = self.out_norm(self.transformer.step(x.reshape(x.shape[0], -1), ring))
        return x, self.text_linear(x)
