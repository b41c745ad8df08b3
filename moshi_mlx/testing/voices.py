"""Voice embedding files as `kyutai/tts-voices` publishes them, for tests, fixtures and the bench.

numpy only (no MLX): the fixture scripts import it from their PyTorch environments.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOICE_TENSOR = "speaker_wavs"  # the one tensor of a published voice file: (1, 512, 125)


def write_voice(
    path: str | Path, speaker_wavs: np.ndarray, metadata: dict[str, str] | None = None
) -> Path:
    """Write a one-tensor float32 voice file, its metadata (if any) in the given order (the
    safetensors package writes metadata in hash order, which changes from run to run): two
    calls with the same arguments write the same bytes. Returns `path`."""
    if speaker_wavs.dtype != np.float32:
        raise TypeError(f"speaker_wavs must be float32, not {speaker_wavs.dtype}")
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    header[VOICE_TENSOR] = {
        "dtype": "F32",
        "shape": list(speaker_wavs.shape),
        "data_offsets": [0, speaker_wavs.nbytes],
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path = Path(path)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + speaker_wavs.tobytes())
    return path


def random_voice(rng: np.random.Generator, dim: int = 512, frames: int = 125) -> np.ndarray:
    """A random voice embedding (1, `dim`, `frames`), standard normal, float32."""
    return rng.standard_normal((1, dim, frames)).astype(np.float32)
