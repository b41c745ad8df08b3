"""What an LM checkpoint's header says, worked out once (`lm_header`) into one record.

From the names, shapes and dtypes of a file's tensors, its metadata and the LM config: the
tensors as the model will hold them (MLX naming, the depformer slices it samples), the
quantization, the parameter count, the compute dtype the loader chooses, and for Kyutai's
PyTorch naming the conversion planned tensor by tensor. Planning memory and loading the weights
both run from this record; neither reads the header again.

The quantization is read from the file: its metadata (`quantization_bits`,
`quantization_group_size`) when present, else the widths of a quantized layer's tensors.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from moshi_mlx.checkpoints.conversion import TensorRecipe, in_pytorch_naming, plan_conversion
from moshi_mlx.checkpoints.io import Layout
from moshi_mlx.checkpoints.spec import BITS_KEY, GROUP_SIZE_KEY, GROUP_SIZES, LOADABLE_BITS
from moshi_mlx.errors import WeightsError
from moshi_mlx.models.lm import Lm, LmConfig

log = logging.getLogger("moshi_mlx.checkpoints")


@dataclass(frozen=True)
class LmHeader:
    """An LM checkpoint as its header describes it: all that planning and loading need."""

    source: str  # the file (for errors)
    config: LmConfig  # with the extra heads the file holds
    layout: Layout  # the tensors as loaded: MLX naming, the depformer slices held
    recipes: tuple[TensorRecipe, ...] | None  # how each is made from Kyutai's PyTorch naming
    sources: tuple[str, ...]  # the file's tensors the model is made of
    quantization: tuple[int, int] | None  # (bits, group size); None: not quantized
    parameters: int  # values the model holds
    dtype: mx.Dtype  # the compute dtype when the caller chooses none (`compute_dtype`)
    full_depformer: bool = False  # whether the user's depformer slices are held too


def lm_header(
    layout: Layout,
    metadata: dict[str, str],
    config: LmConfig,
    source: str,
    full_depformer: bool = False,
) -> LmHeader:
    """The record of an LM checkpoint of this `layout` and `metadata` (its header, read from
    `source`) for `config`; `WeightsError` if its quantization or naming cannot be read."""
    num_slices = depformer_slices(config, full_depformer)
    held = _held_slices_only(layout, config, num_slices)  # PyTorch names pass as they are
    config = _with_heads_of(held, config, source)
    model = Lm(config, full_depformer)  # lazy: nothing is allocated
    quantization = detect_quantization(held, metadata, model, source)
    parameters = parameter_count(model)
    dtype = compute_dtype(parameters, quantized=quantization is not None)
    recipes, sources = None, tuple(held)
    if in_pytorch_naming(layout):
        shapes = {name: shape for name, (shape, _) in layout.items()}
        schedule = config.depformer_weights_per_step_schedule
        _, planned = plan_conversion(shapes, source, config.dep_q, num_slices, schedule)
        converted = {r.target: (r.shape, layout[r.source][1]) for r in planned}
        held = _held_slices_only(converted, config, num_slices)
        recipes = tuple(r for r in planned if r.target in held)
        sources = tuple(dict.fromkeys(r.source for r in recipes))
    return LmHeader(
        source, config, held, recipes, sources, quantization, parameters, dtype, full_depformer
    )


def depformer_slices(config: LmConfig, full_depformer: bool = False) -> int:
    """The depformer slices an `Lm` of `config` holds (see `Lm`)."""
    return config.dep_q if full_depformer else config.moshi_codebooks


def _held_slices_only(entries: dict, config: LmConfig, num_slices: int) -> dict:
    """`entries` by MLX name without those of depformer slices `num_slices` to `dep_q - 1`
    (the slices a file has for the user's codebooks, which the model does not hold)."""
    prefixes = tuple(f"depformer.slices.{k}." for k in range(num_slices, config.dep_q))
    return {name: entry for name, entry in entries.items() if not name.startswith(prefixes)}


def _with_heads_of(layout: Layout, config: LmConfig, source: str) -> LmConfig:
    """`config` with the extra heads the file holds: Kyutai publishes STT weights with and
    without the voice-activity heads under one config (a notice when they differ)."""
    heads = []
    while (name := f"extra_heads.{len(heads)}.weight") in layout:
        heads.append(layout[name][0])
    found = (len(heads), heads[0][0] if heads else config.extra_heads_dim)
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

    bfloat16 on a GPU. On MLX's CPU backend, float32: its quantized kernels are slower and
    less precise with bf16 activations and scales, and a bf16 matrix-vector product gains
    nothing (docs/performance.md, "Float32 compute on the CPU"). Unquantized weights stay
    bf16 on the CPU only when a float32 copy would take more than half the machine's memory.
    """
    if mx.default_device().type != mx.DeviceType.cpu:
        return mx.bfloat16
    if quantized:
        return mx.float32
    float32_bytes = 4 * num_parameters
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return mx.float32 if float32_bytes < memory / 2 else mx.bfloat16
