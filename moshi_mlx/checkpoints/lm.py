"""Moshi LM checkpoints: building the model and loading it strictly.

Files hold `model.safetensors` (bf16, in Kyutai's MLX or PyTorch naming) or
`model.q8.safetensors` / `model.q4.safetensors` (MLX affine quantization: `X.weight` packed
uint32, `X.scales`, `X.biases`). The quantization is read from the file: its metadata
(`quantization_bits`, `quantization_group_size`) when present, else the widths of a quantized
layer's tensors (`header.detect_quantization`). The model takes the depformer slices it
samples (PersonaPlex's files also hold slices for the user's codebooks, left out unless
`full_depformer`). A load reads the file's header once (`header.lm_header` works out from it
all the load needs), then only the tensors the model holds (`lm_from_file`).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx import nn

from moshi_mlx.checkpoints.header import LmHeader, lm_header
from moshi_mlx.checkpoints.io import (
    SafetensorsFile,
    input_major,
    layout_of,
    load_strict,
    read_safetensors,
)
from moshi_mlx.checkpoints.spec import (
    DEFAULT_GROUP_SIZE,
    LM_FILES,
    config_in,
    is_quantized,
    lm_config_from_header,
    read_lm_config,
)
from moshi_mlx.errors import WeightsError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.embeddings import TokenEmbedding

_QUANTIZABLE = (nn.Linear, nn.Embedding)


def build_lm(
    config: LmConfig,
    dtype: mx.Dtype = mx.bfloat16,
    bits: int | None = None,
    group_size: int | None = None,
    full_depformer: bool = False,
) -> Lm:
    """An `Lm` with lazily initialized (unevaluated) weights, optionally quantized like
    Kyutai's files. Nothing is materialized until the weights are evaluated."""
    model = Lm(config, full_depformer)
    model.set_dtype(dtype)
    if bits is not None:
        quantize_lm(model, bits, group_size)
    return model


def quantize_lm(model: Lm, bits: int, group_size: int | None = None) -> None:
    """Quantize in place the Linear and Embedding layers that Kyutai's files quantize
    (`spec.is_quantized`; default group size: Kyutai's 32 for 4 bits, 64 for 8 bits)."""
    group_size = group_size or DEFAULT_GROUP_SIZE.get(bits, 64)

    def quantized(_: str, module: nn.Module) -> bool:
        return isinstance(module, _QUANTIZABLE) and is_quantized(module.weight.shape, group_size)

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=quantized)
    _quantize_tables(
        model, group_size, bits, lambda _, table: is_quantized(table.weight.shape, group_size)
    )


def _quantize_tables(model: Lm, group_size: int, bits: int, chosen) -> None:
    """Quantize the low-rank and two-stream embedding tables (`TokenEmbedding`, which hold
    linears, so `nn.quantize` does not reach them) that `chosen(path, module)` picks."""
    for path, module in model.named_modules():
        if isinstance(module, TokenEmbedding) and chosen(path, module):
            module.quantize_table(group_size, bits)


def _resolve_file(path: str | Path) -> Path:
    """The LM file at `path`, or in the folder `path`: the most precise one when it holds
    several (bf16, then q8, then q4)."""
    path = Path(path)
    if path.is_dir():
        names = [LM_FILES[bits][1] for bits in sorted(LM_FILES, reverse=True)]
        for name in names:
            if (path / name).is_file():
                return path / name
        raise WeightsError(f"no LM checkpoint ({', '.join(names)}) in {path}")
    return path


def load_lm(
    path: str | Path,
    config: LmConfig | None = None,
    dtype: mx.Dtype | None = None,
    full_depformer: bool = False,
) -> Lm:
    """Load an LM checkpoint strictly (a file, or a directory holding one).

    Without `config`, a `config.json` beside the file is read, else the config the file
    carries or its layout says (`spec.lm_config_of`). Floating tensors are cast to `dtype`
    (default: `header.compute_dtype`); the quantization is detected from the file. The header
    is read once (`header.lm_header`), then the tensors the model holds, and the model is built
    once.
    """
    file = _resolve_file(path)
    opened = read_safetensors(file)
    if config is None:
        beside = config_in(file.parent)
        config = (
            read_lm_config(beside)
            if beside
            else lm_config_from_header(opened.layout, opened.metadata, str(file))
        )
    lm = lm_header(opened.layout, opened.metadata, config, str(file), full_depformer)
    return lm_from_file(opened, lm, dtype)


def _hibiki_text_embedding(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hibiki's text embedding with row 2 (EOS) := row 3 (padding), as Kyutai's loader sets it
    so that an early EOS reads as padding; per row, so a quantized table's packed rows,
    scales and biases alike."""
    fixed = dict(tensors)
    for part in ("weight", "scales", "biases"):
        name = f"text_emb.{part}"
        if name in tensors:
            rows = tensors[name]
            fixed[name] = mx.concatenate([rows[:2], rows[3:4], rows[3:]])
    return fixed


def lm_from_file(file: SafetensorsFile, lm: LmHeader, dtype: mx.Dtype | None = None) -> Lm:
    """The LM that `lm` describes, with its tensors read from `file` (opened once, lazily:
    only the tensors the model holds are read). Floating tensors are cast to `dtype`
    (default: the one `lm` records)."""
    model, dtype, input_major_names = _empty_lm(lm, dtype)
    return _filled(model, lm, file.tensors, dtype, input_major_names)


def lm_from_tensors(
    tensors: dict[str, mx.array],
    metadata: dict[str, str],
    config: LmConfig,
    source: str,
    dtype: mx.Dtype | None = None,
    full_depformer: bool = False,
) -> Lm:
    """`load_lm` on a checkpoint's tensors (either naming) and metadata, read from `source`."""
    lm = lm_header(layout_of(tensors), metadata, config, source, full_depformer)
    model, dtype, input_major_names = _empty_lm(lm, dtype)
    return _filled(model, lm, tensors, dtype, input_major_names)


def _empty_lm(lm: LmHeader, dtype: mx.Dtype | None) -> tuple[Lm, mx.Dtype, list[str]]:
    """The lazily built (unevaluated) `Lm` that `lm` describes, in `dtype` (default: the
    record's), quantized as its file is; with the dtype and the names of the weights kept
    input-major (unquantized Linear weights in float32 on the CPU, see `_filled`)."""
    dtype = dtype or lm.dtype
    model = Lm(lm.config, lm.full_depformer)
    model.set_dtype(dtype)
    if lm.quantization is not None:
        bits, group_size = lm.quantization

        def in_file(prefix: str, module: nn.Module) -> bool:
            return isinstance(module, _QUANTIZABLE) and f"{prefix}.scales" in lm.layout

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=in_file)
        _quantize_tables(model, group_size, bits, lambda path, _: f"{path}.scales" in lm.layout)
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    input_major_names = [
        f"{path}.weight"
        for path, module in model.named_modules()
        if on_cpu and dtype == mx.float32 and isinstance(module, nn.Linear)
    ]
    return model, dtype, input_major_names


def sanitize(weights: dict[str, mx.array], lm: LmHeader) -> dict[str, mx.array]:
    """The tensors the model that `lm` describes holds, by MLX name, from a checkpoint's
    `weights` (either naming; lazy arrays of the file are not read here): Kyutai's PyTorch
    names and layouts converted as `lm.recipes` plans, the depformer slices it does not hold
    left out, and Hibiki's text embedding fixed (`_hibiki_text_embedding`)."""
    if lm.recipes is not None:
        weights = {r.target: r.apply(weights[r.source]) for r in lm.recipes}
    else:
        weights = {name: weights[name] for name in lm.layout}
    if lm.config.model_type == "hibiki":
        weights = _hibiki_text_embedding(weights)
    return weights


def _filled(
    model: Lm,
    lm: LmHeader,
    weights: dict[str, mx.array],
    dtype: mx.Dtype,
    input_major_names: list[str],
) -> Lm:
    """`model` loaded strictly with a checkpoint's `weights` (in its file's naming, see
    `sanitize`) and evaluated. Unquantized float32 Linear weights on the CPU
    (`input_major_names`) are kept in (in, out) memory order, same shape and values:
    `x @ weight.T` then reads them contiguously, which MLX's CPU backend does about 1.6x
    faster (Metal's kernels, and bf16, want the stored order)."""
    tensors = sanitize(weights, lm)
    for name in input_major_names:
        if name in tensors:
            tensors[name] = input_major(tensors[name].astype(dtype))
    load_strict(model, tensors, lm.source, dtype=dtype)
    mx.eval(model.parameters())
    return model
