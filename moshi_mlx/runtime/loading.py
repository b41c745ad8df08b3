"""The one load path of every model of the family (chat, STT, TTS), read top to bottom:

1. files (`checkpoints.hub.resolve_weights`): given paths, a local folder laid out like the
   hub repo, the weights folder, then the hub; the config.json is found first and read once.
2. header and config (`checkpoints.io.read_safetensors_header`, `checkpoints.spec`): the LM
   file's header, read once; the LM config (config.json, else the header's metadata, else
   its layout), checked against the model kind before any weight is read.
3. memory (`runtime.memory_plan.plan_memory`): the plan from that header (checked for chat).
4. weights (`checkpoints.lm.load_lm`): the tensors, converted to MLX names
   (`checkpoints.conversion`), loaded strictly in the planned dtype.
5. codec and tokenizer (`runtime.codec`, `runtime.tokenizer`).

`moshi_mlx.load`, `MoshiModel.load`, `SttModel.load` and `TtsModel.load` all come here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import sentencepiece

from moshi_mlx.checkpoints.hub import WeightFiles, resolve_weights
from moshi_mlx.checkpoints.io import Layout, read_safetensors_header
from moshi_mlx.checkpoints.lm import load_lm
from moshi_mlx.checkpoints.spec import (
    DEFAULT_REPO,
    DEFAULT_STT_REPO,
    DEFAULT_TTS_REPO,
    lm_config_from_header,
)
from moshi_mlx.errors import ConfigError, WeightsMismatchError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import Codec, load_codec
from moshi_mlx.runtime.memory_plan import MemoryPlan, check_fits, codec_bytes, plan_memory
from moshi_mlx.runtime.tokenizer import load_tokenizer

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class Kind:
    """What differs between the model kinds on the way in."""

    name: str  # in words, for errors
    model_types: tuple[str, ...]  # the config's `model_type`s it loads
    default_repo: str
    config_required: bool  # whether its repo's config.json names its files
    checks_memory: bool  # whether a plan that does not fit refuses the load


KINDS = {
    "chat": Kind(
        "chat (Moshi, PersonaPlex, Hibiki)", ("moshi", "hibiki"), DEFAULT_REPO, False, True
    ),
    "stt": Kind("speech-to-text", ("stt",), DEFAULT_STT_REPO, True, False),
    "tts": Kind("text-to-speech", ("tts",), DEFAULT_TTS_REPO, True, False),
}
KIND_OF_MODEL_TYPE = {t: name for name, kind in KINDS.items() for t in kind.model_types}


@dataclass(frozen=True)
class LoadOptions:
    """Everything a load takes beside the repo. `quantize`: 4, 8 or 16 (bf16) picks the LM file
    of a Moshi repo; the paths replace the repo's files; `lm_config` is a config.json path or
    an `LmConfig`; `dtype` is the LM's compute dtype (an `mx.Dtype` or "float32",
    "bfloat16", "float16"; default: bf16 on a GPU, float32 on the CPU); `context` shortens the
    attention window; `kv_bits` (8 or 4, with `kv_group_size`) quantizes a chat model's KV
    cache; `check_memory` False loads a chat model that the plan says will not fit."""

    quantize: int | None = None
    moshi_weight: str | Path | None = None
    mimi_weight: str | Path | None = None
    tokenizer: str | Path | None = None
    lm_config: str | Path | LmConfig | None = None
    codec_backend: str = "mlx"
    dtype: mx.Dtype | str | None = None
    context: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    check_memory: bool = True

    @property
    def kv_quantization(self) -> KVQuantization | None:
        return KVQuantization.chosen(self.kv_bits, self.kv_group_size)

    @property
    def compute_dtype(self) -> mx.Dtype | None:
        """`dtype` as an `mx.Dtype` (None: the loader chooses); `ConfigError` for others."""
        if self.dtype is None or isinstance(self.dtype, mx.Dtype):
            return self.dtype
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FoundModel:
    """A model's files, its LM config and its LM file's header (read once), before loading."""

    kind: str  # a key of `KINDS`
    files: WeightFiles
    config: LmConfig
    layout: Layout
    metadata: dict[str, str]


@dataclass(frozen=True)
class LoadedParts:
    """What every model kind is made of once loaded."""

    lm: Lm
    codec: Codec
    tokenizer: sentencepiece.SentencePieceProcessor
    files: WeightFiles
    memory: MemoryPlan
    kv_quantization: KVQuantization | None


def find_model(repo: str | None, options: LoadOptions, kind: str | None = None) -> FoundModel:
    """Steps 1 and 2: the files of `repo` (None: the kind's default repo), the LM config and
    the LM file's header; `kind` None takes the one the config's `model_type` says."""
    given = options.lm_config if isinstance(options.lm_config, LmConfig) else None
    wanted = KINDS[kind or "chat"]
    files = resolve_weights(
        repo or wanted.default_repo,
        options.quantize,
        options.moshi_weight,
        options.mimi_weight,
        options.tokenizer,
        None if given is not None else options.lm_config,
        config_required=kind is not None and wanted.config_required,
    )
    layout, metadata = read_safetensors_header(files.moshi)
    config = given or lm_config_from_header(layout, metadata, str(files.moshi), files.config_data)
    found_kind = KIND_OF_MODEL_TYPE[config.model_type]
    if kind is not None and found_kind != kind:
        source = files.lm_config or files.moshi
        raise ConfigError(
            f"{source} is a {config.model_name} model, not a {KINDS[kind].name} model"
        )
    if options.context is not None:
        if not 1 <= options.context <= config.context:
            raise ConfigError(
                f"context={options.context} is out of range: it must be between 1 and "
                f"{config.context} steps (the model's attention window)"
            )
        config = replace(config, context=options.context)
    if found_kind == "chat":
        check_codec_fits(config)
    elif options.kv_bits is not None:
        raise ConfigError("a quantized KV cache (kv_bits) is for chat models only")
    if found_kind == "tts" and options.codec_backend != "mlx":
        raise ConfigError("the text-to-speech model decodes with the mlx codec only")
    return FoundModel(found_kind, files, config, layout, metadata)


def memory_plan(found: FoundModel, options: LoadOptions) -> MemoryPlan:
    """Step 3: what the model would take in memory, from its files' headers alone;
    `ConfigError` if the KV cache's quantization does not fit the LM's attention heads."""
    kv_quantization = options.kv_quantization
    config = found.config
    if kv_quantization is not None:
        kv_quantization.check_head_dim(config.temporal_config().head_dim)
    codec = codec_bytes(options.codec_backend, found.files.mimi, codec_codebooks(config))
    return plan_memory(
        config,
        found.layout,
        codec,
        options.compute_dtype,
        kv_quantization,
        lm_metadata=found.metadata,
        source=str(found.files.moshi),
    )


def load_parts(repo: str | None, options: LoadOptions, kind: str | None = None) -> LoadedParts:
    """The whole path (see the module docstring): find, plan, load."""
    found = find_model(repo, options, kind)
    plan = memory_plan(found, options)
    if options.check_memory and KINDS[found.kind].checks_memory:
        check_fits(plan, found.config)
    files = found.files
    try:
        lm = load_lm(files.moshi, found.config, plan.dtype)
    except WeightsMismatchError as exc:
        used = files.lm_config or "the one its file carries or its layout says"
        raise WeightsMismatchError(
            f"{exc}; these LM weights do not fit the LM config ({used}): "
            "pass the config.json that belongs to them as lm_config"
        ) from None
    codec = load_codec(files.mimi, options.codec_backend, codec_codebooks(lm.cfg))
    tokenizer = load_tokenizer(files.tokenizer)
    return LoadedParts(lm, codec, tokenizer, files, plan, options.kv_quantization)


def codec_codebooks(config: LmConfig) -> int:
    """The codebooks Mimi encodes or decodes for a model: the user's (chat, STT) or the
    generated ones (chat, TTS)."""
    return max(config.moshi_codebooks, config.num_user_codebooks)


def check_codec_fits(cfg: LmConfig) -> None:
    """Raise `ConfigError` unless a chat LM's audio streams match Mimi's codebooks."""
    if cfg.num_user_codebooks != cfg.moshi_codebooks:
        raise ConfigError(
            f"the LM config has {cfg.moshi_codebooks} Moshi and {cfg.num_user_codebooks} user "
            "codebooks; "
            "the codec needs the same number of both"
        )
    codec_card = MimiConfig.moshi().quantizer.bins
    if cfg.card != codec_card:
        raise ConfigError(
            f"the LM config has {cfg.card} audio tokens per codebook but Mimi has "
            f"{codec_card}: the LM weights or lm_config do not belong to Moshi"
        )
