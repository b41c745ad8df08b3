"""Moshi LM checkpoints: the model a file's header describes, and its tensors as it holds them.

Files hold `model.safetensors` (bf16, in Kyutai's MLX or PyTorch naming) or
`model.q8.safetensors` / `model.q4.safetensors` (MLX affine quantization: `X.weight` packed
uint32, `X.scales`, `X.biases`). The quantization is read from the file: its metadata
(`quantization_bits`, `quantization_group_size`) when present, else the widths of a quantized
layer's tensors (`header.detect_quantization`). The model takes the depformer slices it
samples (PersonaPlex's files also hold slices for the user's codebooks, left out unless
`full_depformer`). `empty_lm` is the model before its weights, `sanitize` the file's tensors
as the model holds them; `runtime.loading.load_parts` puts the two together.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from moshi_mlx.checkpoints.header import LmHeader
from moshi_mlx.checkpoints.spec import DEFAULT_GROUP_SIZE, is_quantized
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.embeddings import TokenEmbedding

_QUANTIZABLE = (nn.Linear, nn.Embedding)


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


def empty_lm(lm: LmHeader, dtype: mx.Dtype | None) -> tuple[Lm, mx.Dtype, list[str]]:
    """The lazily built (unevaluated) `Lm` that `lm` describes, in `dtype` (default: the
    record's), quantized as its file is; with the dtype and the names of the weights kept
    input-major (unquantized Linear weights in float32 on the CPU: `x @ weight.T` then reads
    them contiguously, which MLX's CPU backend does about 1.6x faster; Metal's kernels, and
    bf16, want the stored order)."""
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
