"""Reading any common audio file as 24 kHz mono, and writing wav files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

from moshi_mlx.audio.resample import resample
from moshi_mlx.errors import AudioError

MIN_SAMPLE_RATE = 8000  # below this a file cannot carry intelligible speech


def read_audio(path: str | Path, sample_rate: int = 24_000) -> np.ndarray:
    """Read an audio file (wav, flac, ogg, ...), mix it to mono and resample to `sample_rate`.

    Returns float32 samples in [-1, 1], shape (n,).
    """
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"audio file not found: {path}")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise AudioError(
            f"cannot read {path} as audio ({exc}); give a valid wav/flac/ogg file"
        ) from None
    if rate < MIN_SAMPLE_RATE:
        raise AudioError(
            f"{path} has a sample rate of {rate} Hz, too low for speech; "
            f"record it at {MIN_SAMPLE_RATE} Hz or more (24000 Hz is best)"
        )
    if data.shape[0] == 0:
        raise AudioError(f"{path} contains no audio samples")
    mono = data.mean(axis=1)
    return resample(mono, rate, sample_rate)


def write_audio(path: str | Path, pcm: np.ndarray, sample_rate: int = 24_000) -> None:
    """Write float samples, shape (n,) or (n, channels), as a 16-bit wav file."""
    pcm = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    try:
        sf.write(str(path), pcm, sample_rate, subtype="PCM_16")
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise AudioError(f"cannot write {path}: {exc}") from None


class WavRecorder:
    """Streams frames of several channels into a 16-bit wav file (e.g. user | Moshi)."""

    def __init__(self, path: str | Path, channels: int, sample_rate: int = 24_000):
        self.path = Path(path)
        try:
            self._file = sf.SoundFile(
                str(path), "w", samplerate=sample_rate, channels=channels, subtype="PCM_16"
            )
        except (sf.LibsndfileError, RuntimeError, OSError) as exc:
            raise AudioError(f"cannot create recording {path}: {exc}") from None

    def write(self, *channels: np.ndarray) -> None:
        """Append one block: one (n,) array per channel."""
        self._file.write(np.clip(np.stack(channels, axis=1), -1.0, 1.0))

    def close(self) -> None:
        self._file.close()
