"""Mimi, Kyutai's streaming neural audio codec: 24 kHz mono PCM <-> 12.5 Hz frames of codes.

encode: SEANet encoder -> transformer -> stride-2 conv (25 -> 12.5 Hz) -> split RVQ.
decode: split RVQ -> depthwise transposed conv (12.5 -> 25 Hz) -> transformer -> SEANet decoder.
Public arrays use the conv layout of the reference, (B, C, T); inside, everything is (B, T, C).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.errors import AudioError, ConfigError
from moshi_mlx.modules.conv import Conv1d, ConvState, ConvTranspose1d, ConvTransposeState
from moshi_mlx.modules.kv_cache import KVCache
from moshi_mlx.modules.quantizer import QuantizerConfig, SplitResidualVectorQuantizer
from moshi_mlx.modules.seanet import SeanetConfig, SeanetDecoder, SeanetEncoder
from moshi_mlx.modules.streaming import StateTree
from moshi_mlx.modules.transformer import Transformer, TransformerConfig

BATCH_CHUNK_FRAMES = 25  # batch encode/decode run 2 s at a time: flat memory for long files


def _mimi_transformer(
    d_model: int = 512, num_heads: int = 8, num_layers: int = 8, ffn_hidden: int = 2048
) -> TransformerConfig:
    return TransformerConfig(
        d_model=d_model,
        num_heads=num_heads,
        num_layers=num_layers,
        ffn_hidden=ffn_hidden,
        context=250,
        norm="layer_norm",
        norm_eps=1e-5,
        gated=False,
        positional_embedding="rope",
        max_period=10_000.0,
        layer_scale=0.01,
    )


# Options of Kyutai's Mimi config that this implementation fixes to the published model's values.
_FIXED_OPTIONS = {
    "seanet": {
        "causal": True,
        "pad_mode": "constant",
        "norm": "none",
        "true_skip": True,
        "activation": "ELU",
        "lstm": 0,
    },
    "transformer": {
        "causal": True,
        "norm": "layer_norm",
        "gating": "none",
        "positional_embedding": "rope",
        "conv_layout": True,
    },
}


def _check_supported(config: dict[str, Any]) -> None:
    for section, options in _FIXED_OPTIONS.items():
        for key, supported in options.items():
            value = config.get(section, {}).get(key, supported)
            if value != supported:
                raise ConfigError(
                    f"Mimi config {section}.{key} = {value!r} is not supported (only {supported!r})"
                )


@dataclass(frozen=True)
class MimiConfig:
    sample_rate: int = 24_000
    frame_rate: float = 12.5
    seanet: SeanetConfig = field(default_factory=SeanetConfig)
    transformer: TransformerConfig = field(default_factory=_mimi_transformer)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)

    @classmethod
    def moshi(cls) -> MimiConfig:
        """The published checkpoint (`tokenizer-e351c8d8-checkpoint125.safetensors`)."""
        return cls()

    @classmethod
    def tiny(cls) -> MimiConfig:
        """A small random-weights model for tests: same rates and strides, narrow layers."""
        return cls(
            seanet=SeanetConfig(dimension=32, n_filters=4),
            transformer=_mimi_transformer(d_model=32, num_heads=4, num_layers=2, ffn_hidden=64),
            quantizer=QuantizerConfig(dimension=16, bins=64, total_codebooks=8),
        )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> MimiConfig:
        """Build from Kyutai's Mimi config layout (`sample_rate`, `frame_rate`, and the
        `seanet`, `transformer`, `quantizer` sections as in `moshi.models.loaders`)."""
        _check_supported(config)
        seanet = config.get("seanet", {})
        known = {f.name for f in fields(SeanetConfig)}
        seanet = SeanetConfig(
            **{k: tuple(v) if k == "ratios" else v for k, v in seanet.items() if k in known}
        )
        tr = config.get("transformer", {})
        transformer = replace(
            _mimi_transformer(),
            **{
                ours: tr[theirs]
                for ours, theirs in [
                    ("d_model", "d_model"),
                    ("num_heads", "num_heads"),
                    ("num_layers", "num_layers"),
                    ("ffn_hidden", "dim_feedforward"),
                    ("context", "context"),
                    ("max_period", "max_period"),
                    ("layer_scale", "layer_scale"),
                ]
                if theirs in tr
            },
        )
        qz = config.get("quantizer", {})
        quantizer = QuantizerConfig(
            dimension=qz.get("dimension", 256),
            bins=qz.get("bins", 2048),
            total_codebooks=qz.get("n_q", 32),
            semantic_codebooks=qz.get("n_q_semantic", 1),
        )
        mimi = cls(
            sample_rate=config.get("sample_rate", 24_000),
            frame_rate=config.get("frame_rate", 12.5),
            seanet=seanet,
            transformer=transformer,
            quantizer=quantizer,
        )
        mimi.validate()
        return mimi

    @property
    def frame_size(self) -> int:
        """PCM samples per frame of codes (1920 for Mimi)."""
        return int(self.sample_rate / self.frame_rate)

    @property
    def downsample_stride(self) -> int:
        """Encoder frame rate (25 Hz) over the codes' frame rate (12.5 Hz)."""
        return self.frame_size // self.seanet.hop_length

    def validate(self) -> None:
        if self.frame_size % self.seanet.hop_length != 0:
            raise ConfigError(
                f"frame size {self.frame_size} is not a multiple of the SEANet hop length "
                f"{self.seanet.hop_length}"
            )
        if self.transformer.d_model != self.seanet.dimension:
            raise ConfigError(
                f"transformer d_model {self.transformer.d_model} must equal the SEANet "
                f"dimension {self.seanet.dimension}"
            )


@dataclass
class MimiState(StateTree):
    """Every streaming buffer of a `Mimi`, both directions: a tree of conv states and KV
    caches that the caller makes (`Mimi.make_state`), resets, keeps or saves."""

    encoder: list
    encoder_caches: list[KVCache]
    downsample: ConvState
    upsample: ConvTransposeState
    decoder_caches: list[KVCache]
    decoder: list


class Mimi(nn.Module):
    """The Mimi codec with `num_codebooks` active codebooks (Moshi uses 8)."""

    def __init__(self, config: MimiConfig, num_codebooks: int = 8):
        super().__init__()
        config.validate()
        total = config.quantizer.total_codebooks
        if not config.quantizer.semantic_codebooks <= num_codebooks <= total:
            raise ConfigError(
                f"num_codebooks must be between {config.quantizer.semantic_codebooks} and {total}, "
                f"got {num_codebooks}"
            )
        self.config = config
        self.num_codebooks = num_codebooks
        dim = config.seanet.dimension
        stride = config.downsample_stride
        self.encoder = SeanetEncoder(config.seanet)
        self.encoder_transformer = Transformer(config.transformer)
        self.downsample = Conv1d(dim, dim, 2 * stride, stride, bias=False, pad_mode="replicate")
        self.quantizer = SplitResidualVectorQuantizer(dim, config.quantizer, num_codebooks)
        self.upsample = ConvTranspose1d(dim, dim, 2 * stride, stride, groups=dim, bias=False)
        self.decoder_transformer = Transformer(config.transformer)
        self.decoder = SeanetDecoder(config.seanet)

    @property
    def frame_size(self) -> int:
        return self.config.frame_size

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    def with_codebooks(self, num_codebooks: int, bins: int | None = None) -> Mimi:
        """This codec on its first `num_codebooks` codebooks (Kyutai's `set_num_codebooks`)
        and, given `bins`, on each one's first `bins` entries (the codes an LM of that card
        reads and writes: a recording then encodes to codes below `bins`), sharing its
        weights: what a TTS generating fewer codebooks decodes with."""
        quantizer = self.config.quantizer
        bins = quantizer.bins if bins is None else bins
        if (num_codebooks, bins) == (self.num_codebooks, quantizer.bins):
            return self
        if num_codebooks > self.num_codebooks:
            raise ConfigError(f"this Mimi has {self.num_codebooks} codebooks, not {num_codebooks}")
        if not 1 <= bins <= quantizer.bins:
            raise ConfigError(f"this Mimi has {quantizer.bins} entries per codebook, not {bins}")
        config = replace(self.config, quantizer=replace(quantizer, bins=bins))
        view = Mimi(config, num_codebooks)  # checks the semantic codebooks are kept
        acoustic = num_codebooks - quantizer.semantic_codebooks

        def cut(name: str, array: mx.array) -> mx.array:
            if name.endswith("codebooks"):
                array = array[:acoustic] if name == "quantizer.acoustic.codebooks" else array
                return array if bins == quantizer.bins else array[:, :bins]
            return array

        weights = [
            (name, cut(name, array))
            for name, array in tree_flatten(self.parameters())
            if acoustic > 0 or not name.startswith("quantizer.acoustic.")
        ]
        view.update(tree_unflatten(weights))
        return view

    def make_state(self) -> MimiState:
        """A fresh streaming state for `encode_step` and `decode_step`."""
        return MimiState(
            encoder=self.encoder.make_state(),
            encoder_caches=self.encoder_transformer.make_caches(),
            downsample=ConvState(),
            upsample=ConvTransposeState(),
            decoder_caches=self.decoder_transformer.make_caches(),
            decoder=self.decoder.make_state(),
        )

    # Channels-last internals: pcm (B, T, 1), latent (B, frames, D), codes (B, frames, K).
    def _latent(self, pcm: mx.array, state: MimiState) -> mx.array:
        x = self.encoder(pcm, state.encoder)
        x = self.encoder_transformer(x, state.encoder_caches)
        return self.downsample(x, state.downsample)

    def _pcm(self, codes: mx.array, state: MimiState) -> mx.array:
        x = self.upsample(self.quantizer.decode(codes), state.upsample)
        x = self.decoder_transformer(x, state.decoder_caches)
        return self.decoder(x, state.decoder)

    def _pad_to_frames(self, pcm: mx.array) -> mx.array:
        if pcm.ndim != 3 or pcm.shape[1] != 1:
            raise ValueError(f"expected pcm of shape (B, 1, T), got {tuple(pcm.shape)}")
        missing = -pcm.shape[-1] % self.frame_size
        if missing:
            pcm = mx.pad(pcm, [(0, 0), (0, 0), (0, missing)])
        return pcm.transpose(0, 2, 1)

    def _in_chunks(self, run, inputs: mx.array, chunk: int) -> mx.array:
        """Apply run(chunk_of_inputs, state) along axis 1 with one fresh state: the same result
        as one call on the whole input (the model is causal), with memory bounded by `chunk`."""
        state = self.make_state()
        outputs = []
        for start in range(0, inputs.shape[1], chunk):
            outputs.append(run(inputs[:, start : start + chunk], state))
            mx.eval(outputs[-1], state.state)
        return mx.concatenate(outputs, axis=1)

    def encode_latent(self, pcm: mx.array) -> mx.array:
        """pcm (B, 1, T) -> unquantized latent (B, D, ceil(T / frame_size))."""
        chunk = BATCH_CHUNK_FRAMES * self.frame_size
        return self._in_chunks(self._latent, self._pad_to_frames(pcm), chunk).transpose(0, 2, 1)

    def encode(self, pcm: mx.array) -> mx.array:
        """pcm (B, 1, T) -> codes (B, K, ceil(T / frame_size)); the tail is zero-padded."""

        def run(x: mx.array, state: MimiState) -> mx.array:
            return self.quantizer.encode(self._latent(x, state))

        chunk = BATCH_CHUNK_FRAMES * self.frame_size
        return self._in_chunks(run, self._pad_to_frames(pcm), chunk).transpose(0, 2, 1)

    def decode(self, codes: mx.array) -> mx.array:
        """codes (B, K, frames) -> pcm (B, 1, frames * frame_size)."""
        codes = codes.transpose(0, 2, 1)
        return self._in_chunks(self._pcm, codes, BATCH_CHUNK_FRAMES).transpose(0, 2, 1)

    def encode_step(self, pcm: mx.array, state: MimiState) -> mx.array:
        """One streaming frame: pcm (B, 1, frame_size) -> codes (B, K, 1), lazily (evaluate
        them together with the `state`'s arrays, which it updates)."""
        if pcm.ndim != 3 or pcm.shape[1:] != (1, self.frame_size):
            raise AudioError(
                f"expected pcm of shape (B, 1, {self.frame_size}), got {tuple(pcm.shape)}"
            )
        latent = self._latent(pcm.transpose(0, 2, 1), state)
        return self.quantizer.encode(latent).transpose(0, 2, 1)

    def decode_step(self, codes: mx.array, state: MimiState) -> mx.array:
        """One streaming frame: codes (B, K, 1) -> pcm (B, 1, frame_size), lazily (evaluate
        it together with the `state`'s arrays, which it updates)."""
        if codes.ndim != 3 or codes.shape[1:] != (self.num_codebooks, 1):
            raise AudioError(
                f"expected codes of shape (B, {self.num_codebooks}, 1), got {tuple(codes.shape)}"
            )
        return self._pcm(codes.transpose(0, 2, 1), state).transpose(0, 2, 1)
