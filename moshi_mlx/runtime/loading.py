"""The one load path of every model of the family (chat, STT, TTS), read top to bottom.

Each step uses what the steps before it found and never goes back to a file already read:

1. options (`LoadOptions`): the compute dtype and the KV cache's quantization, checked first.
2. files (`checkpoints.hub.resolve_weights`): given paths, a local folder laid out like the
   hub repo, the weights folder, then the hub; the config.json is found first and read once.
3. header and config (`checkpoints.io.read_safetensors`, `checkpoints.lm_config`): the LM
   file opened once (lazily: its header); the LM config that step 2 found and read, converted
   in that one place (given, config.json, else the header's metadata, else its layout),
   checked against the model kind, the context and the codec.
4. what the header says (`checkpoints.header.lm_header`): one record (`LmHeader`) of the
   tensors as loaded (MLX naming, the depformer slices held; the conversion from PyTorch
   naming planned tensor by tensor), the quantization, the parameter count and the default
   compute dtype.
5. memory (`runtime.memory_plan`): the codec's bytes, then the plan, arithmetic over the
   record and the options (`find_model` ends here: `--memory-plan` reads no weight); for
   chat, a plan that does not fit stops the load.
6. weights (`_build_lm`, the one builder): the model built and quantized from the record
   (`checkpoints.lm.empty_lm`), the file's tensors as it holds them (`checkpoints.lm.
   sanitize`: PyTorch names converted, Hibiki's row fix; only those read), loaded strictly in
   the planned dtype.
7. codec and tokenizer (`runtime.codec`, `runtime.tokenizer`).

`moshi_mlx.load`, `MoshiModel.load`, `SttModel.load` and `TtsModel.load` all come here, and
tools and tests that want an LM alone (`load_parts(..., lm_only=True)`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import mlx.core as mx
import sentencepiece

from moshi_mlx.checkpoints.header import LmHeader, lm_header
from moshi_mlx.checkpoints.hub import WeightFiles, resolve_weights
from moshi_mlx.checkpoints.io import SafetensorsFile, input_major, load_strict, read_safetensors
from moshi_mlx.checkpoints.lm import empty_lm, sanitize
from moshi_mlx.checkpoints.spec import (
    DEFAULT_REPO,
    DEFAULT_STT_REPO,
    DEFAULT_TTS_REPO,
    check_codec_fits,
    codec_codebooks,
)
from moshi_mlx.errors import ConfigError, Setting, WeightsMismatchError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import Codec, load_codec
from moshi_mlx.runtime.memory_plan import MemoryPlan, check_fits, codec_bytes, plan_memory
from moshi_mlx.runtime.tokenizer import load_tokenizer

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class ModelKind:
    """What differs between the model kinds on the way in."""

    name: str  # in words, for errors
    model_types: tuple[str, ...]  # the config's `model_type`s it loads
    default_repo: str
    config_required: bool  # whether its repo's config.json names its files
    checks_memory: bool  # whether a plan that does not fit refuses the load
    options: tuple[str, ...] = ()  # the options of `moshi_mlx.load` for this kind only


KINDS = {
    "chat": ModelKind(
        "chat (Moshi, PersonaPlex, Hibiki)", ("moshi", "hibiki"), DEFAULT_REPO, False, True
    ),
    "stt": ModelKind("speech-to-text", ("stt",), DEFAULT_STT_REPO, True, False),
    "tts": ModelKind(
        "text-to-speech", ("tts",), DEFAULT_TTS_REPO, True, False, ("voice_repo", "n_q")
    ),
}
KIND_OPTIONS = {name for kind in KINDS.values() for name in kind.options}
KIND_OF_MODEL_TYPE = {t: name for name, kind in KINDS.items() for t in kind.model_types}


@dataclass(frozen=True)
class LoadOptions:
    """Everything a load takes beside the repo. `quantize`: 4, 8 or 16 (bf16) picks the LM file
    of a Moshi repo; the paths replace the repo's files; `lm_config` is a config.json path or
    an `LmConfig`; `dtype` is the LM's compute dtype (an `mx.Dtype` or "float32",
    "bfloat16", "float16"; default: bf16 on a GPU, float32 on the CPU); `context` shortens the
    attention window; `kv_bits` (8 or 4, with `kv_group_size`) quantizes a chat model's KV
    cache; `check_memory` False loads a chat model that the plan says will not fit;
    `full_depformer` also keeps the depformer slices of the user's codebooks that
    PersonaPlex's files hold (a repair of its voice prompts uses them)."""

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
    full_depformer: bool = False

    @classmethod
    def named(cls, **options: object) -> LoadOptions:
        """The options given by name, as the `load` functions take them (`**options`);
        `ConfigError` naming an option there is not."""
        known = [field.name for field in fields(cls)]
        for name in options:
            if name not in known:
                raise ConfigError(
                    f"{name!r} is not a load option; the options are {', '.join(known)}",
                    parameter=name,
                )
        return cls(**options)  # type: ignore[arg-type]

    @property
    def kv_quantization(self) -> KVQuantization | None:
        return KVQuantization.chosen(self.kv_bits, self.kv_group_size)

    @property
    def compute_dtype(self) -> mx.Dtype | None:
        """`dtype` as an `mx.Dtype` (None: the loader chooses); `ConfigError` for others."""
        if self.dtype is None or isinstance(self.dtype, mx.Dtype):
            return self.dtype
        if self.dtype not in DTYPES:
            raise ConfigError(
                Setting("dtype"),
                f" must be one of {', '.join(DTYPES)}, got {self.dtype!r}",
                parameter="dtype",
            )
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class FoundModel:
    """A model before any weight is read: its files, its LM file's header (read once), what
    the header says (`lm`, whose config has the options' context), the codebooks its codec
    handles, and the memory plan."""

    kind: str  # a key of `KINDS`
    files: WeightFiles
    header: SafetensorsFile
    lm: LmHeader
    codec_codebooks: int
    memory: MemoryPlan

    @property
    def config(self) -> LmConfig:
        return self.lm.config


@dataclass(frozen=True)
class LoadedParts:
    """What every model kind is made of once loaded."""

    lm: Lm
    codec: Codec | None  # None (and `tokenizer`) when only the LM was loaded (`lm_only`)
    tokenizer: sentencepiece.SentencePieceProcessor | None
    files: WeightFiles
    memory: MemoryPlan
    kv_quantization: KVQuantization | None


def find_model(
    repo: str | None, options: LoadOptions, kind: str | None = None, lm_only: bool = False
) -> FoundModel:
    """Steps 1 to 4 (see the module docstring) for `repo` (None: the kind's default repo);
    `kind` None takes the one the config's `model_type` says; `lm_only`: the LM alone (no
    codec or tokenizer is looked for, its memory is not counted)."""
    dtype, kv_quantization = options.compute_dtype, options.kv_quantization
    wanted = KINDS[kind or "chat"]
    files = resolve_weights(
        repo or wanted.default_repo,
        options.quantize,
        options.moshi_weight,
        options.mimi_weight,
        options.tokenizer,
        options.lm_config,
        config_required=kind is not None and wanted.config_required,
        lm_only=lm_only,
    )
    header = read_safetensors(files.moshi)
    config = files.config.lm_config(header)
    found_kind = KIND_OF_MODEL_TYPE[config.model_type]
    if kind is not None and found_kind != kind:
        raise ConfigError(
            f"{files.config.path or files.moshi} is a {config.model_name} model, not a "
            f"{KINDS[kind].name} model"
        )
    if options.context is not None:
        if not 1 <= options.context <= config.context:
            raise ConfigError(
                Setting("context", options.context),
                f" is out of range: it must be between 1 and {config.context} steps (the "
                "model's attention window)",
                parameter="context",
            )
        config = replace(config, context=options.context)
    if found_kind == "chat" and not lm_only:
        check_codec_fits(config)
    elif found_kind != "chat" and options.kv_bits is not None:
        raise ConfigError(
            "a quantized KV cache (",
            Setting("kv_bits"),
            ") is for chat models only",
            parameter="kv_bits",
        )
    if found_kind == "tts" and options.codec_backend != "mlx":
        raise ConfigError("the text-to-speech model decodes with the mlx codec only")
    codebooks = codec_codebooks(config)
    if kv_quantization is not None:
        kv_quantization.check_head_dim(config.temporal_config().head_dim)
    lm = lm_header(header.layout, header.metadata, config, str(files.moshi), options.full_depformer)
    codec = 0 if lm_only else codec_bytes(options.codec_backend, files.mimi, codebooks)
    memory = plan_memory(lm, codec, dtype, kv_quantization)
    return FoundModel(found_kind, files, header, lm, codebooks, memory)


def load_parts(
    repo: str | None,
    options: LoadOptions,
    kind: str | None = None,
    kind_options: Iterable[str] = (),
    lm_only: bool = False,
) -> LoadedParts:
    """The whole path (see the module docstring), the one way a model is built: find and
    plan, check, load. `kind_options` names the options given that only some kinds take
    (`ModelKind.options`): `ConfigError`, before any weight is read, when the model found is not
    of such a kind. `lm_only`: the LM alone (no codec or tokenizer, no memory check), for
    tools and tests."""
    found = find_model(repo, options, kind, lm_only)
    for name in kind_options:
        if name not in KINDS[found.kind].options:
            takers = " or ".join(k.name for k in KINDS.values() if name in k.options)
            raise ConfigError(
                Setting(name),
                f" is a {takers} option; {found.files.repo} is a {found.config.model_name} model",
                parameter=name,
            )
    if options.check_memory and KINDS[found.kind].checks_memory and not lm_only:
        check_fits(found.memory, found.lm.config)
    files = found.files
    try:
        lm = _build_lm(found.lm, found.header.tensors, found.memory.dtype)
    except WeightsMismatchError as exc:
        used = files.config.path or "the one its file carries or its layout says"
        raise WeightsMismatchError(
            *exc.parts,
            f"; these LM weights do not fit the LM config ({used}): pass the config.json "
            "that belongs to them as ",
            Setting("lm_config"),
            parameter="lm_config",
        ) from None
    if lm_only:
        return LoadedParts(lm, None, None, files, found.memory, found.memory.kv)
    codec = load_codec(files.mimi, options.codec_backend, found.codec_codebooks)
    tokenizer = load_tokenizer(files.tokenizer)
    return LoadedParts(lm, codec, tokenizer, files, found.memory, found.memory.kv)


def _build_lm(lm: LmHeader, weights: dict[str, mx.array], dtype: mx.Dtype) -> Lm:
    """The model `lm` describes, loaded strictly with the file's `weights` (lazy: only those
    it holds are read, through `sanitize`) and evaluated, in `dtype`."""
    model, dtype, input_major_names = empty_lm(lm, dtype)
    tensors = sanitize(weights, lm)
    for name in input_major_names:
        if name in tensors:
            tensors[name] = input_major(tensors[name].astype(dtype))
    load_strict(model, tensors, lm.source, dtype=dtype)
    mx.eval(model.parameters())
    return model
