"""`LmConfig`: the architecture of every model of the family, in Kyutai's `config.json` terms.

One schema for Moshi, PersonaPlex, Kyutai's speech-to-text (`model_type` "stt": no depformer,
32 audio streams in, text and voice-activity heads out), Hibiki (`model_type` "hibiki": a
condition table summed into the input, classifier-free guidance) and Hibiki-Zero (also "hibiki":
grouped-query attention, split-halves RoPE, depformer output norms, no condition). `LmConfig.from_dict` reads
every key those models publish; a key it does not know, or a value it does not support, is a
`ConfigError` naming it, never ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.condition_config import (
    Conditioner,
    Fuser,
    conditioner_from_dict,
)
from moshi_mlx.models.config_keys import (
    DEPFORMER_KEYS,
    FIXED_KEYS,
    REQUIRED_KEYS,
    WRITTEN_FIXED_KEYS,
    check_positive_int,
    is_personaplex_in_nvidia_terms,
)
from moshi_mlx.models.config_sections import GenDefaults, ModelId, SttTiming, TtsTiming
from moshi_mlx.modules.transformer import TransformerConfig

MOSHI_DELAYS = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
NORM_EPS = {"rms_norm_f32": 1e-8, "rms_norm": 1e-5}
_POSITIONAL = ("rope", "rope_concat", "none")  # interleaved, split-halves or no RoPE
_DEPFORMER_NORMS = (None, "layer_norm")
_GENERATORS = ("moshi", "personaplex")
MODEL_TYPES = ("moshi", "stt", "hibiki", "tts")


def gated_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of a gated FFN, by the reference's rule for `dim_feedforward`."""
    if dim_feedforward == 4 * dim:
        return 21 * dim // 8
    return 2 * dim_feedforward // 3


@dataclass(frozen=True)
class LmConfig:
    """Architecture of a model of the Moshi family, in the terms of Kyutai's `config.json`."""

    dim: int
    num_heads: int
    num_layers: int
    hidden_scale: float
    context: int
    card: int
    text_card: int
    n_q: int
    dep_q: int
    delays: tuple[int, ...]
    # The depformer's sizes: required when dep_q > 0 (Kyutai's STT has none).
    depformer_dim: int = 0
    depformer_num_heads: int = 0
    depformer_num_layers: int = 0
    depformer_dim_feedforward: int = 0
    max_period: float = 10_000.0
    positional_embedding: str = "rope"
    norm: str = "rms_norm_f32"
    gating: str = "silu"
    depformer_context: int = 8
    depformer_max_period: float = 10_000.0
    depformer_pos_emb: str = "none"
    # Each key/value head serves `kv_repeat` query heads (grouped-query attention, Hibiki-Zero).
    kv_repeat: int = 1
    # A norm of each depformer slice's output before its head (Hibiki-Zero: "layer_norm").
    depformer_norm: str | None = None
    # Slice k of the depformer uses the weights of slice schedule[k] (Hibiki); None: its own.
    depformer_weights_per_step_schedule: tuple[int, ...] | None = None
    # Depformer token embeddings of this rank, projected up to depformer_dim (Hibiki).
    depformer_low_rank_embeddings: int | None = None
    existing_text_padding_id: int = 3
    # The text head's vocabulary when smaller than the input's (tts-0.75b-en-public: 5, the
    # schedule's word and padding tokens and the speaker tokens); None: `text_card`.
    text_card_out: int | None = None
    # Heads on the temporal transformer's output beside the text (STT's voice activity).
    extra_heads_num_heads: int = 0
    extra_heads_dim: int = 6
    # Conditions summed into every step's input (Hibiki's "description", the TTS's "cfg" and
    # "control") or attended to by cross-attention (the TTS's "speaker_wavs"), as `fuser` says.
    conditioners: tuple[Conditioner, ...] = ()
    fuser: Fuser = field(default_factory=Fuser)
    # Temporal layers attend to the cross-attended conditions (TTS).
    cross_attention: bool = False
    # The text stream carries two tokens per step, `(second + 1) * (text_card + 1) + first`,
    # embedded by one table and two projections (TTS).
    demux_second_stream: bool = False
    model_type: str = "moshi"
    stt_config: SttTiming | None = None
    tts_config: TtsTiming | None = None
    model_id: ModelId | None = None
    lm_gen_config: GenDefaults = field(default_factory=GenDefaults)
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
        schedule = self.depformer_weights_per_step_schedule
        if schedule is not None:
            object.__setattr__(
                self, "depformer_weights_per_step_schedule", tuple(int(s) for s in schedule)
            )
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
        """Read Kyutai's `config.json`; an unknown key or unsupported value is a `ConfigError`."""
        missing = [key for key in REQUIRED_KEYS if key not in data]
        if missing:
            raise ConfigError(f"LM config is missing key(s): {', '.join(missing)}")
        for key, accepted in FIXED_KEYS.items():
            value = data.get(key, accepted)
            if value != accepted and not (accepted is None and not value):
                raise ConfigError(
                    f"LM config key {key!r} = {value!r} is not supported (expected {accepted!r})"
                )
        known = {f.name for f in fields(cls)}
        aliases = {"demux_second_text_stream"}
        unknown = sorted(set(data) - known - set(FIXED_KEYS) - aliases)
        if unknown:
            raise ConfigError(f"LM config has key(s) moshi_mlx does not know: {', '.join(unknown)}")
        kwargs = {key: data[key] for key in known if key in data and data[key] is not None}
        if is_personaplex_in_nvidia_terms(data):
            kwargs.update(user_codebooks=data["n_q"] // 2, generator="personaplex")
        if data.get("demux_second_text_stream"):  # PyTorch's LMModel spelling
            kwargs["demux_second_stream"] = True
        kwargs.setdefault("hidden_scale", 4.125)
        kwargs.setdefault("context", 3000)
        if data["dep_q"]:
            for key in DEPFORMER_KEYS:
                if key not in kwargs:
                    raise ConfigError(f"LM config is missing key: {key}")
            kwargs.setdefault(
                "depformer_dim_feedforward", int(kwargs["hidden_scale"] * kwargs["depformer_dim"])
            )
        else:  # sizes of a depformer the model does not have
            for key in (*DEPFORMER_KEYS, "depformer_dim_feedforward"):
                kwargs.pop(key, None)
        if "stt_config" in kwargs:
            kwargs["stt_config"] = SttTiming.from_dict(kwargs["stt_config"])
        kwargs["lm_gen_config"] = GenDefaults.from_dict(kwargs.get("lm_gen_config", {}))
        conditioners = kwargs.get("conditioners", {})
        if not isinstance(conditioners, dict):
            raise ConfigError(f"LM config conditioners must be an object, got {conditioners!r}")
        kwargs["conditioners"] = tuple(
            conditioner_from_dict(name, spec) for name, spec in conditioners.items()
        )
        kwargs["fuser"] = Fuser.from_dict(data.get("fuser"), kwargs["conditioners"])
        if "tts_config" in kwargs:
            kwargs["tts_config"] = TtsTiming.from_dict(kwargs["tts_config"])
        if "model_id" in kwargs:
            kwargs["model_id"] = ModelId.from_dict(kwargs["model_id"])
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
        if self.dep_q == 0:
            for key in (*DEPFORMER_KEYS, "depformer_dim_feedforward"):
                del data[key]
        for key in (
            "depformer_weights_per_step_schedule",
            "depformer_low_rank_embeddings",
            "depformer_norm",
        ):
            if data[key] is None:
                del data[key]
            elif key.endswith("schedule"):
                data[key] = list(data[key])
        if self.stt_config is None:
            del data["stt_config"]
        data["lm_gen_config"] = {k: v for k, v in data["lm_gen_config"].items() if v is not None}
        if self.conditioners:
            data["conditioners"] = {c.name: c.to_dict() for c in self.conditioners}
            data["fuser"] = self.fuser.to_dict()
        else:
            del data["conditioners"], data["fuser"]
        for key in ("tts_config", "model_id"):
            value = getattr(self, key)
            if value is None:
                del data[key]
            elif key == "tts_config":
                data[key] = value.to_dict()
        if self.kv_repeat == 1:
            del data["kv_repeat"]
        if self.text_card_out is None:
            del data["text_card_out"]
        if not self.cross_attention:
            del data["cross_attention"]
        if not self.demux_second_stream:
            del data["demux_second_stream"]
        data.update({key: FIXED_KEYS[key] for key in WRITTEN_FIXED_KEYS})
        return data

    def validate(self) -> None:
        """Raise `ConfigError` if the configuration is inconsistent or unsupported."""
        ints = ("dim", "num_heads", "num_layers", "context", "card", "text_card", "n_q")
        if self.dep_q:
            ints += (*DEPFORMER_KEYS, "depformer_dim_feedforward")
        for name in ints:
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.dep_q, int) or self.dep_q < 0:
            raise ConfigError(f"LM config dep_q must be an integer >= 0, got {self.dep_q!r}")
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
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"LM config model_type {self.model_type!r} is not supported (one of {MODEL_TYPES})"
            )
        if self.model_type == "stt" and self.dep_q:
            raise ConfigError(f"LM config of an STT model must have dep_q = 0, got {self.dep_q}")
        if (self.model_type == "tts") != (self.tts_config is not None):
            raise ConfigError("LM config needs tts_config exactly when model_type is 'tts'")
        if self.cross_attention != bool(self.fuser.cross):
            raise ConfigError(
                "LM config cross_attention must be true exactly when the fuser has 'cross' "
                f"conditions, got cross_attention {self.cross_attention} and {list(self.fuser.cross)}"
            )
        check_positive_int("kv_repeat", self.kv_repeat)
        if self.num_heads % self.kv_repeat:
            raise ConfigError(
                f"LM config kv_repeat = {self.kv_repeat} must divide num_heads = {self.num_heads}"
            )
        if self.depformer_norm not in _DEPFORMER_NORMS:
            raise ConfigError(
                f"LM config depformer_norm {self.depformer_norm!r} is not supported "
                "(null or 'layer_norm')"
            )
        heads = [("", self.dim, self.num_heads)]
        if self.dep_q:
            heads.append(("depformer_", self.depformer_dim, self.depformer_num_heads))
        for prefix, dim, num_heads in heads:
            if dim % num_heads or (dim // num_heads) % 2:
                raise ConfigError(
                    f"LM config {prefix}dim = {dim} must split into {num_heads} heads of even width"
                )
        if self.norm not in NORM_EPS:
            raise ConfigError(f"LM config norm {self.norm!r} is not one of {sorted(NORM_EPS)}")
        if self.gating != "silu":
            raise ConfigError(f"LM config gating {self.gating!r} is not supported (only 'silu')")
        for name in ("positional_embedding", "depformer_pos_emb"):
            if getattr(self, name) not in _POSITIONAL:
                raise ConfigError(f"LM config {name} must be one of {_POSITIONAL}")
        if self.hidden_scale <= 0:
            raise ConfigError(f"LM config hidden_scale must be > 0, got {self.hidden_scale}")
        if self.text_card_out is not None:
            check_positive_int("text_card_out", self.text_card_out)
        if not 0 <= self.existing_text_padding_id < self.text_card:
            raise ConfigError("LM config existing_text_padding_id must be a text token id")
        if self.extra_heads_num_heads:
            check_positive_int("extra_heads_dim", self.extra_heads_dim)
        if not isinstance(self.extra_heads_num_heads, int) or self.extra_heads_num_heads < 0:
            raise ConfigError("LM config extra_heads_num_heads must be an integer >= 0")
        self._validate_depformer_variants()

    def _validate_depformer_variants(self) -> None:
        schedule = self.depformer_weights_per_step_schedule
        if schedule is not None and (
            len(schedule) != self.dep_q or any(s < 0 or s >= self.dep_q for s in schedule)
        ):
            raise ConfigError(
                "LM config depformer_weights_per_step_schedule must give each of the "
                f"dep_q = {self.dep_q} slices a slice index, got {list(schedule)}"
            )
        rank = self.depformer_low_rank_embeddings
        if rank is not None:
            check_positive_int("depformer_low_rank_embeddings", rank)

    # Derived sizes ----------------------------------------------------------------------
    @property
    def num_codebooks(self) -> int:
        """Streams per step: text plus `n_q` audio codebooks."""
        return self.n_q + 1

    @property
    def num_user_codebooks(self) -> int:
        """The input audio codebooks (the user's; STT's and Hibiki's source speech): the last
        audio streams (`user_codebooks`, else the `n_q` streams past Moshi's `dep_q`)."""
        return self.n_q - self.dep_q if self.user_codebooks is None else self.user_codebooks

    @property
    def moshi_codebooks(self) -> int:
        """The generated audio codebooks: the first audio streams, sampled by the depformer's
        first slices and played (PersonaPlex's later slices predict the user's streams)."""
        return self.n_q - self.num_user_codebooks

    @property
    def model_name(self) -> str:
        """What users call this model: Moshi, PersonaPlex, Hibiki, Hibiki-Zero (a Hibiki
        with grouped-query attention), Kyutai STT or Kyutai TTS."""
        if self.generator == "personaplex":
            return "PersonaPlex"
        if self.model_type == "hibiki" and self.kv_repeat > 1:
            return "Hibiki-Zero"
        names = {"hibiki": "Hibiki", "stt": "Kyutai STT", "tts": "Kyutai TTS"}
        return names.get(self.model_type, "Moshi")

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
        frame one step further ahead than Kyutai's (its first call only fills the delayed tokens)."""
        return 1 if self.generator == "personaplex" else 0

    @property
    def start_tokens(self) -> tuple[int, ...]:
        """Each stream's start token, fed while its delay runs: text, then every audio
        codebook; each is its stream's largest id (one past its vocabulary)."""
        return (self.text_card,) + (self.card,) * self.n_q

    @property
    def text_vocab_out(self) -> int:
        """The text head's logits per step: `text_card_out`, else `text_card`."""
        return self.text_card if self.text_card_out is None else self.text_card_out

    @property
    def direct_guidance(self) -> bool:
        """Whether this TTS runs classifier-free guidance as a second, null batch row
        (tts-0.75b-en-public), having no distilled guidance ("cfg") condition to take it."""
        return self.model_type == "tts" and "cfg" not in self.fuser.sum

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def kv_dim(self) -> int:
        """Width of one position's keys (and values) in a temporal layer: `dim`, or its
        `kv_repeat`-th part under grouped-query attention."""
        return self.dim // self.kv_repeat

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
            norm_eps=NORM_EPS[self.norm],
            positional_embedding=self.positional_embedding,
            max_period=self.max_period,
            cross_attention=self.cross_attention,
            kv_repeat=self.kv_repeat,
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
            norm_eps=NORM_EPS[self.norm],
            positional_embedding=self.depformer_pos_emb,
            max_period=self.depformer_max_period,
        )
