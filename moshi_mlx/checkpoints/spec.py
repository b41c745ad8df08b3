"""Facts about Kyutai's published Moshi files, written once: names, quantization, config rule.

Every other module asks here: the hub for file names and repos, the LM loader and the quantizer
for which tensors are quantized and how it is recorded (an LM file's config included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from moshi_mlx.checkpoints.io import Layout
from moshi_mlx.errors import ConfigError, Setting
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.models.mimi import MimiConfig

DEFAULT_REPO = "kyutai/moshiko-mlx-q4"
# Kyutai's speech-to-text with its voice-activity heads (PyTorch naming; file names in its
# config.json, as in every delayed-streams repo: STT, Hibiki).
DEFAULT_STT_REPO = "kyutai/stt-1b-en_fr"
DEFAULT_TTS_REPO = "kyutai/tts-1.6b-en_fr"
DEFAULT_VOICE_REPO = "kyutai/tts-voices"  # the TTS voices (speaker embeddings)
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
# Our LM files carry their config (Kyutai's config.json keys, as JSON) in this metadata key.
CONFIG_KEY = "lm_config"


@dataclass(frozen=True)
class RepoFacts:
    """What a known hub repo publishes where it differs from Kyutai's Moshi repos."""

    lm_bits: tuple[int, ...]  # precisions of its LM files (16: bf16)
    read_config: bool  # whether its config.json is Kyutai's schema (else: from the layout)
    voices: str | None = None  # archive of voice prompts


PERSONAPLEX_REPO = "nvidia/personaplex-7b-v1"
KNOWN_REPOS = {
    # bf16 PyTorch naming only; its config.json is NVIDIA's own, its layout says what it is.
    PERSONAPLEX_REPO: RepoFacts(lm_bits=(16,), read_config=False, voices="voices.tgz"),
}
# Who publishes the models above: a repo id of another owner may be a mistyped folder.
PUBLISHERS = frozenset(
    repo.split("/")[0]
    for repo in (DEFAULT_REPO, DEFAULT_STT_REPO, DEFAULT_TTS_REPO, DEFAULT_VOICE_REPO, *KNOWN_REPOS)
)


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


def codec_codebooks(config: LmConfig) -> int:
    """The codebooks Mimi encodes or decodes for a model: the user's (chat, STT) or the
    generated ones (chat, TTS)."""
    return max(config.moshi_codebooks, config.num_user_codebooks)


def check_codec_fits(config: LmConfig) -> None:
    """Raise `ConfigError` unless a chat LM's audio streams match Mimi's codebooks."""
    if config.num_user_codebooks != config.moshi_codebooks:
        raise ConfigError(
            f"the LM config has {config.moshi_codebooks} Moshi and {config.num_user_codebooks} user "
            "codebooks; "
            "the codec needs the same number of both"
        )
    codec_card = MimiConfig.moshi().quantizer.bins
    if config.card != codec_card:
        raise ConfigError(
            f"the LM config has {config.card} audio tokens per codebook but Mimi has "
            f"{codec_card}: the LM weights or ",
            Setting("lm_config"),
            " do not belong to Moshi",
        )


def config_metadata(config: LmConfig) -> dict[str, str]:
    """The metadata entry that makes an LM file carry its config."""
    return {CONFIG_KEY: json.dumps(config.to_dict(), sort_keys=True)}
