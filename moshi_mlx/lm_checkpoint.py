"""Moshi LM checkpoints in Kyutai's MLX format: strict loading and random test files.

Files hold `model.safetensors` (bf16) or `model.q8.safetensors` / `model.q4.safetensors`
(MLX affine quantization: `X.weight` packed uint32, `X.scales`, `X.biases`). The quantization
is read from the file: its metadata (`quantization_bits`, `quantization_group_size`) when
present, else the widths of a quantized layer's tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.errors import WeightsError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.weights import SafetensorsWriter, load_strict, read_json, read_safetensors

DEFAULT_GROUP_SIZE = {4: 32, 8: 64}  # as in Kyutai's published q4 / q8 files
CHECKPOINT_NAMES = ("model.safetensors", "model.q8.safetensors", "model.q4.safetensors")
_QUANTIZABLE = (nn.Linear, nn.Embedding)
_SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
_SUPPORTED_GROUPS = (32, 64, 128)


def build_lm(
    config: LmConfig,
    dtype: mx.Dtype = mx.bfloat16,
    bits: int | None = None,
    group_size: int | None = None,
) -> Lm:
    """An `Lm` with lazily initialized (unevaluated) weights, optionally quantized like
    Kyutai's files. Nothing is materialized until the weights are evaluated."""
    model = Lm(config)
    model.set_dtype(dtype)
    if bits is not None:
        quantize_lm(model, bits, group_size)
    return model


def quantize_lm(model: Lm, bits: int, group_size: int | None = None) -> None:
    """Quantize in place every Linear and Embedding whose input width divides by the group
    size (default: Kyutai's 32 for 4 bits, 64 for 8 bits)."""
    group_size = group_size or DEFAULT_GROUP_SIZE.get(bits, 64)
    nn.quantize(
        model, group_size=group_size, bits=bits,
        class_predicate=lambda _, m: isinstance(m, _QUANTIZABLE)
        and m.weight.shape[-1] % group_size == 0,
    )  # fmt: skip


def _resolve_file(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        for name in CHECKPOINT_NAMES:
            if (path / name).is_file():
                return path / name
        raise WeightsError(f"no LM checkpoint ({', '.join(CHECKPOINT_NAMES)}) in {path}")
    return path


def detect_quantization(
    tensors: dict[str, mx.array], metadata: dict[str, str], config: LmConfig, source: str
) -> tuple[int, int] | None:
    """(bits, group_size) of a checkpoint, or None when it is not quantized."""
    scales = sorted(name for name in tensors if name.endswith(".scales"))
    if not scales:
        if "quantization_bits" in metadata:
            raise WeightsError(f"{source}: metadata declares quantization but no tensor is")
        return None
    layer = scales[0].removesuffix(".scales")
    float_params = dict(tree_flatten(Lm(config).parameters()))
    reference = float_params.get(f"{layer}.weight")
    packed = tensors.get(f"{layer}.weight")
    if reference is None or packed is None or packed.dtype != mx.uint32:
        raise WeightsError(f"{source}: unexpected quantized tensor {scales[0]}")
    in_features = reference.shape[-1]
    bits, rem_bits = divmod(packed.shape[-1] * 32, in_features)
    group_size, rem_group = divmod(in_features, max(tensors[scales[0]].shape[-1], 1))
    if "quantization_bits" in metadata or "quantization_group_size" in metadata:
        try:
            declared = (int(metadata["quantization_bits"]),
                        int(metadata["quantization_group_size"]))  # fmt: skip
        except (KeyError, ValueError):
            raise WeightsError(f"{source}: malformed quantization metadata {metadata}") from None
        if declared != (bits, group_size) or rem_bits or rem_group:
            raise WeightsError(
                f"{source}: metadata declares {declared[0]}-bit group {declared[1]} but tensor "
                f"{layer}.weight is packed as {packed.shape[-1] * 32 / in_features:g}-bit "
                f"with {tensors[scales[0]].shape[-1]} groups for {in_features} inputs"
            )
    if rem_bits or rem_group or bits not in _SUPPORTED_BITS or group_size not in _SUPPORTED_GROUPS:
        raise WeightsError(
            f"{source}: cannot read the quantization of {layer}: weight {tuple(packed.shape)}, "
            f"scales {tuple(tensors[scales[0]].shape)} for {in_features} inputs"
        )
    return bits, group_size


def compute_dtype(config: LmConfig, quantized: bool) -> mx.Dtype:
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
    float32_bytes = 4 * sum(p.size for _, p in tree_flatten(Lm(config).parameters()))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return mx.float32 if float32_bytes < memory / 2 else mx.bfloat16


def _store_input_major(model: Lm) -> None:
    """Give unquantized Linear weights (in, out) memory order, same shape and values.

    `x @ weight.T` then reads the weight contiguously, which MLX's CPU backend does about
    1.6x faster in float32 (and slower in bf16, where this is not used). Only for float32
    weights on the CPU; Metal's kernels want the stored (out, in) order.
    """
    for _, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype == mx.float32:
            module.weight = mx.contiguous(module.weight.T).T


def load_lm(path: str | Path, config: LmConfig | None = None, dtype: mx.Dtype | None = None) -> Lm:
    """Load an LM checkpoint strictly (a file, or a directory holding one).

    Without `config`, a `config.json` beside the file is read, else Moshi 7B is assumed.
    Floating tensors are cast to `dtype` (default: `compute_dtype`); the quantization is
    detected from the file.
    """
    file = _resolve_file(path)
    tensors, metadata = read_safetensors(file)
    if config is None:
        config_file = file.parent / "config.json"
        config = (
            LmConfig.from_dict(read_json(config_file)) if config_file.is_file()
            else LmConfig.moshi_7b()
        )  # fmt: skip
    quantization = detect_quantization(tensors, metadata, config, str(file))
    if dtype is None:
        dtype = compute_dtype(config, quantized=quantization is not None)
    model = Lm(config)
    model.set_dtype(dtype)
    if quantization is not None:
        bits, group_size = quantization
        nn.quantize(
            model, group_size=group_size, bits=bits,
            class_predicate=lambda p, m: isinstance(m, _QUANTIZABLE) and f"{p}.scales" in tensors,
        )  # fmt: skip
    load_strict(model, tensors, str(file), dtype=dtype)
    if mx.default_device().type == mx.DeviceType.cpu:
        _store_input_major(model)
    mx.eval(model.parameters())
    return model


def save_safetensors_lazily(path: str | Path, tensors: dict[str, mx.array]) -> None:
    """Write lazy arrays to a safetensors file, evaluating and releasing one at a time.

    Memory stays at about one tensor, so a 7B-sized random checkpoint never sits in memory
    whole. `tensors` is emptied as it is written.
    """
    layout = {name: (tuple(tensors[name].shape), tensors[name].dtype) for name in sorted(tensors)}
    with open(path, "wb") as file:
        writer = SafetensorsWriter(file, layout, metadata={})
        for name in layout:
            array = tensors.pop(name)
            mx.eval(array)
            writer.write_rows(name, 0, array)
            del array
        writer.check_complete()


def _random_weights(model: Lm, seed: int) -> dict[str, mx.array]:
    """Uniform weights with variance 1/fan_in (cheaper to draw than Gaussians at 7B scale),
    norm gains in [0.8, 1.2]."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for (name, p), key in zip(params, keys):
        if p.ndim == 1:
            weights[name] = mx.random.uniform(0.8, 1.2, p.shape, key=key)
        else:
            bound = (3 / p.shape[-1]) ** 0.5
            weights[name] = mx.random.uniform(-bound, bound, p.shape, key=key)
    return weights


def write_random_lm_checkpoint(
    path: str | Path,
    config: LmConfig,
    bits: int | None = None,
    group_size: int | None = None,
    seed: int = 0,
    write_config: bool = False,
) -> Path:
    """Write a random checkpoint in Kyutai's MLX format (bf16, or quantized when `bits`).

    `path` is the file, or a directory that receives `model.safetensors` /
    `model.q{bits}.safetensors`. With `write_config`, Kyutai's `config.json` is written
    beside it. Returns the checkpoint's path.
    """
    path = Path(path)
    if path.is_dir() or not path.suffix:
        name = "model.safetensors" if bits is None else f"model.q{bits}.safetensors"
        path = path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_lm(config, dtype=mx.float32)
    model.update(tree_unflatten(list(_random_weights(model, seed).items())))
    model.set_dtype(mx.bfloat16)
    if bits is not None:
        quantize_lm(model, bits, group_size)
    weights = dict(tree_flatten(model.parameters()))
    del model
    save_safetensors_lazily(path, weights)
    if write_config:
        (path.parent / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return path
