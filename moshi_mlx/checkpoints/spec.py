"""Facts about Kyutai's published Moshi files, written once: names, quantization, config rule.

Every other module asks here: the hub for file names and repos, the LM loader and the quantizer
for which tensors are quantized and how it is recorded, the API and the quantizer for which LM
config belongs to a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx

from moshi_mlx.checkpoints.io import Layout, read_json
from moshi_mlx.models.lm import LmConfig

DEFAULT_REPO = "kyutai/moshiko-mlx-q4"
MIMI_FILE = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_FILE = "tokenizer_spm_32k_3.model"
CONFIG_FILE = "config.json"

# LM precision (bits; 16 = the bf16 release) -> (repo name suffix, LM file name)
LM_FILES = {
    4: ("q4", "model.q4.safetensors"),
    8: ("q8", "model.q8.safetensors"),
    16: ("bf16", "model.safetensors"),
}

# The quantization rule. Kyutai's q4 files use group 32, its q8 files group 64; any of
# GROUP_SIZES can be written and read. Files record what they hold in their metadata.
DEFAULT_GROUP_SIZE = {4: 32, 8: 64}
GROUP_SIZES = (32, 64, 128)
LOADABLE_BITS = (2, 3, 4, 5, 6, 8)  # MLX's affine quantization
BITS_KEY, GROUP_SIZE_KEY = "quantization_bits", "quantization_group_size"


def is_quantized(shape: tuple[int, ...], group_size: int | None) -> bool:
    """Whether a tensor of this (MLX) shape is quantized, never when `group_size` is None:
    every Linear and Embedding weight (2-D) whose input width divides by the group size;
    norms (1-D) stay bf16."""
    return group_size is not None and len(shape) == 2 and shape[1] % group_size == 0


def output_layout(
    mlx_shapes: Mapping[str, tuple[int, ...]], bits: int, group_size: int | None
) -> Layout:
    """Names, shapes and dtypes of an LM file in Kyutai's layout, sorted by name, for MLX-named
    parameter shapes, quantized to `bits` with `group_size` (None: bf16)."""
    layout: Layout = {}
    for name, shape in mlx_shapes.items():
        if not is_quantized(shape, group_size):
            layout[name] = (tuple(shape), mx.bfloat16)
            continue
        rows, cols = shape
        prefix = name.removesuffix(".weight")
        layout[name] = ((rows, cols * bits // 32), mx.uint32)
        layout[prefix + ".scales"] = ((rows, cols // group_size), mx.bfloat16)
        layout[prefix + ".biases"] = ((rows, cols // group_size), mx.bfloat16)
    return dict(sorted(layout.items()))


def quantization_metadata(bits: int, group_size: int | None) -> dict[str, str]:
    """The safetensors metadata of an LM file of this precision (16 bits: none)."""
    if bits == 16:
        return {"format": "mlx"}
    return {"format": "mlx", BITS_KEY: str(bits), GROUP_SIZE_KEY: str(group_size)}


def config_in(folder: str | Path) -> Path | None:
    """Kyutai's `config.json` in this folder (e.g. beside the LM weights), if there is one."""
    candidate = Path(folder) / CONFIG_FILE
    return candidate if candidate.is_file() else None


def read_lm_config(path: str | Path | None) -> LmConfig:
    """The LM config of a Kyutai `config.json`, or Moshi 7B's when there is none."""
    return LmConfig.from_dict(read_json(path)) if path is not None else LmConfig.moshi_7b()
