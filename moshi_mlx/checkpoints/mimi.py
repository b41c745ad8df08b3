"""Mimi checkpoints in Kyutai's published PyTorch layout: names, conv layouts, codebooks.

`mimi_tensor_table` holds what this package knows of Mimi's file format: it lists every tensor of the
published file (PyTorch name and shape), the `Mimi` parameter it becomes, and how its layout
changes. Loading and the random test checkpoints of `moshi_mlx.testing.checkpoints` both read that table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx

from moshi_mlx.checkpoints.io import check_tensors, input_major, load_strict, read_safetensors
from moshi_mlx.errors import ConfigError, WeightsError
from moshi_mlx.models.mimi import Mimi, MimiConfig

CLUSTER_USAGE_EPS = 1e-5  # the reference clamps codebook usage counts to this before dividing
# A file's metadata key holding its Mimi config (Kyutai's layout, JSON) when it is not the
# published model's: the small random codecs of `moshi_mlx.testing.checkpoints`.
MIMI_CONFIG_KEY = "mimi_config"

Layout = Literal[
    "same",  # norms, biases, layer scales
    "linear",  # (out, in), stored input-major (see `input_major`)
    "conv",  # (out, in, k) -> (k, in, out)
    "convtr",  # (in, out, k) -> (in, k, out): our transposed conv is a matmul per step
    "depthwise_convtr",  # (C, 1, k) -> (k, C)
    "pointwise",  # 1x1 conv (out, in, 1) -> linear (out, in), stored input-major
    "embedding_sum",  # codebook k: sum of assigned vectors (bins, dim)
    "cluster_usage",  # codebook k: usage counts (bins,)
    "flag",  # `_initialized`, not needed for inference
]


@dataclass(frozen=True)
class TensorEntry:
    name: str  # PyTorch name in the file
    shape: tuple[int, ...]  # PyTorch shape in the file
    target: str  # Mimi parameter (for codebook parts: the stacked codebooks array)
    layout: Layout
    codebook: int = -1  # index within `target` for codebook parts


def _conv(name: str, target: str, c_out: int, c_in: int, kernel: int, bias: bool = True):
    yield TensorEntry(f"{name}.weight", (c_out, c_in, kernel), f"{target}.weight", "conv")
    if bias:
        yield TensorEntry(f"{name}.bias", (c_out,), f"{target}.bias", "same")


def _resnet(name: str, target: str, dim: int, config: MimiConfig):
    hidden = dim // config.seanet.compress
    kernel = config.seanet.residual_kernel_size
    yield from _conv(f"{name}.block.1.conv.conv", f"{target}.conv1", hidden, dim, kernel)
    yield from _conv(f"{name}.block.3.conv.conv", f"{target}.conv2", dim, hidden, 1)


def _encoder(config: MimiConfig):
    sn = config.seanet
    yield from _conv(
        "encoder.model.0.conv.conv", "encoder.init_conv", sn.n_filters, sn.channels, sn.kernel_size
    )
    index, dim = 1, sn.n_filters
    for i, ratio in enumerate(reversed(sn.ratios)):
        for j in range(sn.n_residual_layers):
            yield from _resnet(
                f"encoder.model.{index}", f"encoder.blocks.{i}.residuals.{j}", dim, config
            )
            index += 1
        index += 1  # ELU
        yield from _conv(
            f"encoder.model.{index}.conv.conv",
            f"encoder.blocks.{i}.downsample",
            2 * dim,
            dim,
            2 * ratio,
        )
        index, dim = index + 1, 2 * dim
    index += 1  # ELU
    yield from _conv(
        f"encoder.model.{index}.conv.conv",
        "encoder.final_conv",
        sn.dimension,
        dim,
        sn.last_kernel_size,
    )


def _decoder(config: MimiConfig):
    sn = config.seanet
    dim = sn.n_filters * 2 ** len(sn.ratios)
    yield from _conv(
        "decoder.model.0.conv.conv", "decoder.init_conv", dim, sn.dimension, sn.kernel_size
    )
    index = 1
    for i, ratio in enumerate(sn.ratios):
        index += 1  # ELU
        name, target = f"decoder.model.{index}.convtr.convtr", f"decoder.blocks.{i}.upsample"
        yield TensorEntry(
            f"{name}.weight", (dim, dim // 2, 2 * ratio), f"{target}.weight", "convtr"
        )
        yield TensorEntry(f"{name}.bias", (dim // 2,), f"{target}.bias", "same")
        index, dim = index + 1, dim // 2
        for j in range(sn.n_residual_layers):
            yield from _resnet(
                f"decoder.model.{index}", f"decoder.blocks.{i}.residuals.{j}", dim, config
            )
            index += 1
    index += 1  # ELU
    yield from _conv(
        f"decoder.model.{index}.conv.conv",
        "decoder.final_conv",
        sn.channels,
        dim,
        sn.last_kernel_size,
    )


def _transformer(side: str, config: MimiConfig):
    tr = config.transformer
    d, ff = tr.d_model, tr.ffn_hidden
    for layer in range(tr.num_layers):
        name = f"{side}_transformer.transformer.layers.{layer}"
        target = f"{side}_transformer.layers.{layer}"
        for torch_suffix, ours, shape in [
            ("self_attn.in_proj_weight", "self_attn.in_proj.weight", (3 * d, d)),
            ("self_attn.out_proj.weight", "self_attn.out_proj.weight", (d, d)),
            ("norm1.weight", "norm1.weight", (d,)),
            ("norm1.bias", "norm1.bias", (d,)),
            ("norm2.weight", "norm2.weight", (d,)),
            ("norm2.bias", "norm2.bias", (d,)),
            ("linear1.weight", "linear1.weight", (ff, d)),
            ("linear2.weight", "linear2.weight", (d, ff)),
            ("layer_scale_1.scale", "layer_scale_1.scale", (d,)),
            ("layer_scale_2.scale", "layer_scale_2.scale", (d,)),
        ]:
            layout = "linear" if len(shape) == 2 else "same"
            yield TensorEntry(f"{name}.{torch_suffix}", shape, f"{target}.{ours}", layout)


def _quantizer(config: MimiConfig):
    qz, latent = config.quantizer, config.seanet.dimension
    halves = [
        ("rvq_first", "semantic", qz.semantic_codebooks),
        ("rvq_rest", "acoustic", qz.total_codebooks - qz.semantic_codebooks),
    ]
    for name, target, count in halves:
        name, target = f"quantizer.{name}", f"quantizer.{target}"
        yield TensorEntry(
            f"{name}.input_proj.weight",
            (qz.dimension, latent, 1),
            f"{target}.input_proj.weight",
            "pointwise",
        )
        yield TensorEntry(
            f"{name}.output_proj.weight",
            (latent, qz.dimension, 1),
            f"{target}.output_proj.weight",
            "pointwise",
        )
        for k in range(count):
            prefix = f"{name}.vq.layers.{k}._codebook"
            codebooks = f"{target}.codebooks"
            yield TensorEntry(f"{prefix}._initialized", (1,), codebooks, "flag", k)
            yield TensorEntry(f"{prefix}.cluster_usage", (qz.bins,), codebooks, "cluster_usage", k)
            yield TensorEntry(
                f"{prefix}.embedding_sum", (qz.bins, qz.dimension), codebooks, "embedding_sum", k
            )


def mimi_tensor_table(config: MimiConfig) -> list[TensorEntry]:
    """Every tensor of a Mimi checkpoint in the published PyTorch layout, in file order."""
    dim, stride = config.seanet.dimension, config.downsample_stride
    return [
        *_encoder(config),
        *_decoder(config),
        *_transformer("encoder", config),
        *_transformer("decoder", config),
        *_quantizer(config),
        TensorEntry(
            "downsample.conv.conv.conv.weight", (dim, dim, 2 * stride), "downsample.weight", "conv"
        ),
        TensorEntry(
            "upsample.convtr.convtr.convtr.weight",
            (dim, 1, 2 * stride),
            "upsample.weight",
            "depthwise_convtr",
        ),
    ]


_LAYOUT_CHANGES = {
    "same": lambda w: w,
    "linear": input_major,
    "conv": lambda w: mx.contiguous(w.transpose(2, 1, 0)),
    "convtr": lambda w: mx.contiguous(w.transpose(0, 2, 1)),
    "depthwise_convtr": lambda w: mx.contiguous(w[:, 0, :].T),
    "pointwise": lambda w: input_major(w[:, :, 0]),
}


def convert_mimi_tensors(
    tensors: dict[str, mx.array], config: MimiConfig, num_codebooks: int
) -> dict[str, mx.array]:
    """PyTorch-layout tensors -> `Mimi` parameters (codebooks = sum / clamped usage, stacked)."""
    converted: dict[str, mx.array] = {}
    sums: dict[str, dict[int, mx.array]] = {}
    usages: dict[str, dict[int, mx.array]] = {}
    num_acoustic = num_codebooks - config.quantizer.semantic_codebooks
    for entry in mimi_tensor_table(config):
        if entry.target.startswith("quantizer.acoustic") and num_acoustic == 0:
            continue
        tensor = tensors[entry.name]
        if entry.layout in _LAYOUT_CHANGES:
            converted[entry.target] = _LAYOUT_CHANGES[entry.layout](tensor)
        elif entry.target.startswith("quantizer.acoustic") and entry.codebook >= num_acoustic:
            continue
        elif entry.layout == "embedding_sum":
            sums.setdefault(entry.target, {})[entry.codebook] = tensor
        elif entry.layout == "cluster_usage":
            usages.setdefault(entry.target, {})[entry.codebook] = tensor
    for target, by_index in sums.items():
        codebooks = [
            by_index[k] / mx.maximum(usages[target][k], CLUSTER_USAGE_EPS)[:, None]
            for k in sorted(by_index)
        ]
        converted[target] = mx.stack(codebooks)
    return converted


def mimi_config_from_metadata(metadata: dict[str, str], source: str | Path) -> MimiConfig:
    """The Mimi config a file's metadata carries (`MIMI_CONFIG_KEY`), else the published
    model's."""
    text = metadata.get(MIMI_CONFIG_KEY)
    if text is None:
        return MimiConfig.moshi()
    try:
        return MimiConfig.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError, ConfigError) as exc:
        raise WeightsError(
            f"{source}: its {MIMI_CONFIG_KEY} metadata is not valid: {exc}"
        ) from None


def load_mimi(path: str | Path, num_codebooks: int = 8, config: MimiConfig | None = None) -> Mimi:
    """Load a Mimi checkpoint in the published PyTorch layout (strict: every tensor, exact
    shapes), in float32, with `num_codebooks` active codebooks; `config` None: the one the
    file's metadata carries, else the published model's."""
    file = read_safetensors(path)
    tensors, metadata = file.tensors, file.metadata
    config = config or mimi_config_from_metadata(metadata, path)
    model = Mimi(config, num_codebooks)
    expected = {entry.name: (entry.shape, None) for entry in mimi_tensor_table(config)}
    check_tensors(expected, tensors, str(path))
    tensors = {name: t.astype(mx.float32) for name, t in tensors.items()}
    load_strict(model, convert_mimi_tensors(tensors, config, num_codebooks), str(path), mx.float32)
    mx.eval(model.parameters(), model.quantizer.search_tables())
    return model
