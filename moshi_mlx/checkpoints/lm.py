"""Moshi LM checkpoints: building the model and loading it strictly.

Files hold `model.safetensors` (bf16, in Kyutai's MLX or PyTorch naming) or
`model.q8.safetensors` / `model.q4.safetensors` (MLX affine quantization: `X.weight` packed
uint32, `X.scales`, `X.biases`). The quantization is read from the file: its metadata
(`quantization_bits`, `quantization_group_size`) when present, else the widths of a quantized
layer's tensors. The model takes the depformer slices it samples (PersonaPlex's files also
hold slices for the user's codebooks, left out unless `full_depformer`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from moshi_mlx.checkpoints.conversion import in_pytorch_naming, plan_conversion, to_mlx_naming
from moshi_mlx.checkpoints.io import (
    Layout,
    input_major,
    layout_of,
    load_strict,
    read_safetensors,
)
from moshi_mlx.checkpoints.spec import (
    BITS_KEY,
    DEFAULT_GROUP_SIZE,
    GROUP_SIZE_KEY,
    GROUP_SIZES,
    LM_FILES,
    LOADABLE_BITS,
    config_in,
    is_quantized,
    lm_config_of,
)
from moshi_mlx.errors import WeightsError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.embeddings import TokenEmbedding

_QUANTIZABLE = (nn.Linear, nn.Embedding)
log = logging.getLogger("moshi_mlx.checkpoints")


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


def detect_quantization(
    layout: Layout, metadata: dict[str, str], model: Lm, source: str
) -> tuple[int, int] | None:
    """(bits, group_size) of a checkpoint from its tensors' names, shapes and dtypes (`layout`,
    e.g. a file's header) and metadata, or None when it is not quantized; `model` is the
    unquantized `Lm` it is meant for (its weights' shapes tell the input widths)."""
    scales = sorted(name for name in layout if name.endswith(".scales"))
    if not scales:
        if BITS_KEY in metadata:
            raise WeightsError(f"{source}: metadata declares quantization but no tensor is")
        return None
    layer = scales[0].removesuffix(".scales")
    float_params = dict(tree_flatten(model.parameters()))
    reference = float_params.get(f"{layer}.weight")
    packed_shape, packed_dtype = layout.get(f"{layer}.weight", ((), None))
    if reference is None or packed_dtype != mx.uint32:
        raise WeightsError(f"{source}: unexpected quantized tensor {scales[0]}")
    scales_shape = layout[scales[0]][0]
    in_features = reference.shape[-1]
    bits, rem_bits = divmod(packed_shape[-1] * 32, in_features)
    group_size, rem_group = divmod(in_features, max(scales_shape[-1], 1))
    if BITS_KEY in metadata or GROUP_SIZE_KEY in metadata:
        try:
            declared = (int(metadata[BITS_KEY]), int(metadata[GROUP_SIZE_KEY]))
        except (KeyError, ValueError):
            raise WeightsError(f"{source}: malformed quantization metadata {metadata}") from None
        if declared != (bits, group_size) or rem_bits or rem_group:
            raise WeightsError(
                f"{source}: metadata declares {declared[0]}-bit group {declared[1]} but tensor "
                f"{layer}.weight is packed as {packed_shape[-1] * 32 / in_features:g}-bit "
                f"with {scales_shape[-1]} groups for {in_features} inputs"
            )
    if rem_bits or rem_group or bits not in LOADABLE_BITS or group_size not in GROUP_SIZES:
        raise WeightsError(
            f"{source}: cannot read the quantization of {layer}: weight {tuple(packed_shape)}, "
            f"scales {tuple(scales_shape)} for {in_features} inputs"
        )
    return bits, group_size


def parameter_count(model: nn.Module) -> int:
    """How many values the model's parameters hold (a lazily built model allocates nothing);
    modules shared by several names (a depformer's scheduled weights) count once."""
    unique = {id(p): p for _, p in tree_flatten(model.parameters())}
    return sum(p.size for p in unique.values())


def compute_dtype(num_parameters: int, quantized: bool) -> mx.Dtype:
    """The dtype to compute in when the caller does not choose one.

    bfloat16 on a GPU. On MLX's CPU backend, float32: its quantized kernels are about 8x
    slower and much less precise with bf16 activations and scales, and a bf16 matrix-vector
    product is no faster than a float32 one. Unquantized weights stay bf16 on the CPU only
    when a float32 copy would take more than half the machine's memory.
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return mx.bfloat16
    if quantized:
        return mx.float32
    float32_bytes = 4 * num_parameters
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return mx.float32 if float32_bytes < memory / 2 else mx.bfloat16


def _store_input_major(model: Lm) -> None:
    """Give unquantized Linear weights (in, out) memory order, same shape and values.

    `x @ weight.T` then reads the weight contiguously, which MLX's CPU backend does about
    1.6x faster in float32 (and slower in bf16, where this is not used). Only for float32
    weights on the CPU; Metal's kernels want the stored (out, in) order.
    """
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == mx.float32:
            module.weight = input_major(module.weight)


def load_lm(
    path: str | Path,
    config: LmConfig | None = None,
    dtype: mx.Dtype | None = None,
    full_depformer: bool = False,
) -> Lm:
    """Load an LM checkpoint strictly (a file, or a directory holding one).

    Without `config`, a `config.json` beside the file is read, else the config the file
    carries or its layout says (`spec.lm_config_of`). Floating tensors are cast to `dtype`
    (default: `compute_dtype`); the quantization is detected from the file. The file is read
    once and the model built once.
    """
    file = _resolve_file(path)
    tensors, metadata = read_safetensors(file)
    if config is None:
        config = lm_config_of(file, config_in(file.parent))
    return lm_from_tensors(tensors, metadata, config, str(file), dtype, full_depformer)


def depformer_slices(config: LmConfig, full_depformer: bool = False) -> int:
    """The depformer slices an `Lm` of `config` holds (see `Lm`)."""
    return config.dep_q if full_depformer else config.moshi_codebooks


def _held_slices_only(entries: dict, config: LmConfig, num_slices: int) -> dict:
    """`entries` by MLX name without those of depformer slices `num_slices` to `dep_q - 1`
    (the slices a file has for the user's codebooks, which the model does not hold)."""
    prefixes = tuple(f"depformer.slices.{k}." for k in range(num_slices, config.dep_q))
    return {name: entry for name, entry in entries.items() if not name.startswith(prefixes)}


def loaded_layout(layout: Layout, config: LmConfig, source: str = "the LM file") -> Layout:
    """The names, shapes and dtypes of a file's tensors as `load_lm` keeps them (MLX naming,
    the depformer slices the model samples), from the file's layout alone."""
    num_slices = depformer_slices(config)
    if in_pytorch_naming(layout):
        shapes = {name: shape for name, (shape, _) in layout.items()}
        _, recipes = plan_conversion(
            shapes, source, config.dep_q, num_slices, config.depformer_weights_per_step_schedule
        )
        layout = {r.target: (r.shape, layout[r.source][1]) for r in recipes}
    return _held_slices_only(layout, config, num_slices)


def _model_tensors(
    tensors: dict[str, mx.array], config: LmConfig, full_depformer: bool, source: str
) -> dict[str, mx.array]:
    """A checkpoint's tensors in MLX naming, with the depformer slices the model holds."""
    num_slices = depformer_slices(config, full_depformer)
    if in_pytorch_naming(tensors):
        schedule = config.depformer_weights_per_step_schedule
        tensors = to_mlx_naming(tensors, source, config.dep_q, num_slices, schedule)
    return _held_slices_only(tensors, config, num_slices)


def _with_heads_of(tensors: dict[str, mx.array], config: LmConfig, source: str) -> LmConfig:
    """`config` with the extra heads the file holds: Kyutai publishes STT weights with and
    without the voice-activity heads under one config (a notice when they differ)."""
    heads = []
    while (name := f"extra_heads.{len(heads)}.weight") in tensors:
        heads.append(tensors[name])
    found = (len(heads), heads[0].shape[0] if heads else config.extra_heads_dim)
    if found == (config.extra_heads_num_heads, config.extra_heads_dim):
        return config
    if heads or config.extra_heads_num_heads:
        log.info(
            "%s: %d extra (voice-activity) heads in the file, the config says %d",
            source,
            len(heads),
            config.extra_heads_num_heads,
        )
    return replace(config, extra_heads_num_heads=found[0], extra_heads_dim=found[1])


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


def lm_from_tensors(
    tensors: dict[str, mx.array],
    metadata: dict[str, str],
    config: LmConfig,
    source: str,
    dtype: mx.Dtype | None = None,
    full_depformer: bool = False,
) -> Lm:
    """`load_lm` on a checkpoint's tensors (either naming) and metadata, read from `source`."""
    tensors = _model_tensors(tensors, config, full_depformer, source)
    if config.model_type == "hibiki":
        tensors = _hibiki_text_embedding(tensors)
    config = _with_heads_of(tensors, config, source)
    model = Lm(config, full_depformer)  # lazy: its float parameters are never materialized
    quantization = detect_quantization(layout_of(tensors), metadata, model, source)
    if dtype is None:
        dtype = compute_dtype(parameter_count(model), quantized=quantization is not None)
    model.set_dtype(dtype)
    if quantization is not None:
        bits, group_size = quantization

        def in_file(prefix: str, module: nn.Module) -> bool:
            return isinstance(module, _QUANTIZABLE) and f"{prefix}.scales" in tensors

        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=in_file)
        _quantize_tables(model, group_size, bits, lambda path, _: f"{path}.scales" in tensors)
    load_strict(model, tensors, source, dtype=dtype)
    if mx.default_device().type == mx.DeviceType.cpu:
        _store_input_major(model)
    mx.eval(model.parameters())
    return model
