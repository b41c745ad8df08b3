"""One streaming codec interface over two Mimi backends: our MLX model and `rustymimi`.

Both take and return one 80 ms frame at a time as numpy arrays:
`encode_step(pcm (1920,) float32) -> codes (num_codebooks,) int32` and back. `rustymimi`
(Kyutai's Rust Mimi, `pip install moshi_mlx[rustymimi]`) runs on the CPU and keeps the codec
off the GPU; it reads the same published checkpoint file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.errors import MoshiError, WeightsError
from moshi_mlx.models.mimi import Mimi

SAMPLE_RATE = 24_000
FRAME_SIZE = 1920
BACKENDS = ("mlx", "rustymimi")


@runtime_checkable
class Codec(Protocol):
    """A streaming audio codec: one frame of PCM <-> one frame of codes."""

    sample_rate: int
    frame_size: int
    num_codebooks: int

    def encode_step(self, pcm: np.ndarray) -> np.ndarray:
        """pcm (frame_size,) float32 -> codes (num_codebooks,) int32."""
        ...

    def decode_step(self, codes: np.ndarray) -> np.ndarray:
        """codes (num_codebooks,) integers -> pcm (frame_size,) float32."""
        ...

    def reset(self) -> None:
        """Start a new stream in both directions."""
        ...


def _check_pcm(pcm: np.ndarray) -> np.ndarray:
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.shape != (FRAME_SIZE,):
        raise ValueError(f"expected one frame of pcm, shape ({FRAME_SIZE},), got {pcm.shape}")
    return pcm


def _check_codes(codes: np.ndarray, num_codebooks: int) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.shape != (num_codebooks,):
        raise ValueError(f"expected codes of shape ({num_codebooks},), got {codes.shape}")
    return codes


class MlxCodec:
    """Our MLX Mimi behind the `Codec` interface."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(self, model: Mimi):
        self.model = model
        self.num_codebooks = model.num_codebooks

    def encode_step(self, pcm: np.ndarray) -> np.ndarray:
        frame = mx.array(_check_pcm(pcm))[None, None, :]
        return np.array(self.model.encode_step(frame)[0, :, 0]).astype(np.int32)

    def decode_step(self, codes: np.ndarray) -> np.ndarray:
        codes = _check_codes(codes, self.num_codebooks)
        pcm = self.model.decode_step(mx.array(codes.astype(np.uint32))[None, :, None])
        return np.array(pcm[0, 0])

    def reset(self) -> None:
        self.model.reset()


class RustyMimiCodec:
    """Kyutai's Rust Mimi (`rustymimi.Tokenizer`) behind the `Codec` interface."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(self, weight_path: str | Path, num_codebooks: int = 8):
        try:
            import rustymimi
        except ImportError:
            raise MoshiError(
                "the rustymimi codec backend is not installed: "
                "pip install 'moshi_mlx[rustymimi]', or use backend='mlx'"
            ) from None
        self._rustymimi = rustymimi
        self.weight_path = str(weight_path)
        self.num_codebooks = num_codebooks
        self._tokenizer = self._open()

    def _open(self):
        try:
            return self._rustymimi.Tokenizer(self.weight_path, num_codebooks=self.num_codebooks)
        except (ValueError, RuntimeError, OSError) as exc:  # what rustymimi raises
            reason = str(exc).splitlines()[0]  # drop the Rust backtrace
            raise WeightsError(f"rustymimi cannot load {self.weight_path}: {reason}") from None

    def encode_step(self, pcm: np.ndarray) -> np.ndarray:
        codes = self._tokenizer.encode_step(_check_pcm(pcm)[None, None, :])
        return np.asarray(codes, dtype=np.int32).reshape(self.num_codebooks)

    def decode_step(self, codes: np.ndarray) -> np.ndarray:
        codes = _check_codes(codes, self.num_codebooks).astype(np.uint32)
        pcm = self._tokenizer.decode_step(codes[None, :, None])
        return np.asarray(pcm, dtype=np.float32).reshape(self.frame_size)

    def reset(self) -> None:
        # rustymimi 0.4's Tokenizer.reset() leaves part of the encoder's state (the first frame
        # after it encodes differently from a fresh stream), so open the file again (~1 s).
        self._tokenizer = self._open()


def load_codec(weight_path: str | Path, backend: str = "mlx", num_codebooks: int = 8) -> Codec:
    """Open the Mimi checkpoint at `weight_path` with the named backend ("mlx" or "rustymimi")."""
    if backend == "mlx":
        return MlxCodec(load_mimi(weight_path, num_codebooks=num_codebooks))
    if backend == "rustymimi":
        if not Path(weight_path).is_file():
            raise WeightsError(f"weights file not found: {weight_path}")
        return RustyMimiCodec(weight_path, num_codebooks)
    raise MoshiError(f"unknown codec backend {backend!r}; choose one of {', '.join(BACKENDS)}")
