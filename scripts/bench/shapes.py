"""The bench's shapes and compute dtypes, and its random inputs."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np
from bench_stats import LM_SHAPES, QUANT_BITS, TTS_SHAPES

from moshi_mlx.models.lm import Lm

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "LM_SHAPES",
    "QUANT_BITS",
    "TTS_SHAPES",
    "dtype_label",
    "lm_shapes",
    "noise_frames",
    "tts_shapes",
    "user_codes",
]

# Our compute dtype: "auto" is `load_lm`'s own choice for the device (float32 on the CPU).
DTYPES = {"auto": None, "bf16": mx.bfloat16, "f32": mx.float32}
DTYPE_NAMES = {mx.bfloat16: "bf16", mx.float32: "f32"}


def dtype_label(requested: mx.Dtype | None, lm: Lm) -> str:
    used = DTYPE_NAMES[lm.out_norm.weight.dtype]
    return used if requested is not None else f"auto:{used}"


def lm_shapes(shapes: Iterable[str]) -> list[str]:
    """The LM shapes of `--shapes`, in its order."""
    return [shape for shape in shapes if shape in LM_SHAPES]


def tts_shapes(shapes: list[str]) -> list[str]:
    """The TTS shapes of `--shapes`; tts-small when it names none."""
    return [shape for shape in shapes if shape in TTS_SHAPES] or ["tts-small"]


def user_codes(card: int, count: int, seed: int, codebooks: int = 8) -> np.ndarray:
    """Random input codes (count, codebooks): the user's (Hibiki-Zero's source: 16)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, card, size=(count, codebooks)).astype(np.int32)


def noise_frames(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal((count, 1920))).astype(np.float32)
