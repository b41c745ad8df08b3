"""Reading any common audio file as 24 kHz mono, and writing wav files."""

from __future__ import annotations

import io
import os
import re
import struct
from pathlib import Path

import numpy as np
import soundfile as sf

from moshi_mlx.audio import SAMPLE_RATE
from moshi_mlx.audio.resample import Resampler
from moshi_mlx.errors import AudioError

MIN_SAMPLE_RATE = 8000  # below this a file cannot carry intelligible speech
BLOCK_SAMPLES = 1 << 20  # decoded at once (all channels): 4 MB of float32
# libsndfile names a file object by its repr in messages: "<_io.BytesIO object at 0x...>".
_OBJECT_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")


def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read an audio file (wav, flac, ogg, ...), mix it to mono and resample to `sample_rate`.

    Returns float32 samples in [-1, 1], shape (n,).
    """
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"audio file not found: {path}")
    if path.stat().st_size == 0:
        raise AudioError(f"{path} is empty; give a wav/flac/ogg file")
    return _decode(str(path), str(path), sample_rate, None)


def decode_audio(
    data: bytes,
    sample_rate: int = 24_000,
    max_seconds: float | None = None,
    name: str = "the audio",
) -> np.ndarray:
    """`read_audio` of a file's bytes; `AudioError` (naming it `name`) for bytes that are not
    audio libsndfile reads, or audio longer than `max_seconds` (checked before decoding)."""
    if not data:
        raise AudioError(f"{name} is empty; give a wav/flac/ogg file")
    return _decode(io.BytesIO(data), name, sample_rate, max_seconds)


def _decode(
    source: str | io.BytesIO, name: str, sample_rate: int, max_seconds: float | None
) -> np.ndarray:
    """Decode block by block, mixing each to mono and resampling it as it comes, so that a
    decode holds the output and one block, whatever the file's rate, channels or header say
    (a capped decode: at most `max_seconds` of output)."""
    try:
        with sf.SoundFile(source) as file:
            rate = file.samplerate
            if rate < MIN_SAMPLE_RATE:
                raise AudioError(
                    f"{name} has a sample rate of {rate} Hz, too low for speech; "
                    f"record it at {MIN_SAMPLE_RATE} Hz or more (24000 Hz is best)"
                )
            limit = None if max_seconds is None else int(max_seconds * rate)
            if limit is not None and file.frames > limit:
                raise _too_long(name, file.frames / rate, max_seconds)
            resampler = Resampler(rate, sample_rate)
            blocks, frames = [], 0
            block_frames = max(1, BLOCK_SAMPLES // file.channels)
            for block in file.blocks(block_frames, dtype="float32", always_2d=True):
                frames += len(block)
                if limit is not None and frames > limit:
                    raise _too_long(name, frames / rate, max_seconds)
                blocks.append(resampler.push(block.mean(axis=1)))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        detail = getattr(exc, "error_string", None) or _OBJECT_REPR.sub("the file", str(exc))
        raise AudioError(
            f"cannot read {name} as audio ({detail}); give a valid wav/flac/ogg file"
        ) from None
    if frames == 0:
        raise AudioError(f"{name} contains no audio samples")
    return np.concatenate([*blocks, resampler.finish()])


def _too_long(name: str, seconds: float, max_seconds: float) -> AudioError:
    return AudioError(f"{name} lasts {seconds:.1f} s, more than the {max_seconds:g} s allowed")


def check_audio_name(path: str | Path) -> None:
    """`AudioError` unless `path` ends in the name of a format libsndfile writes (.wav, ...)."""
    if Path(path).suffix.lstrip(".").upper() not in sf.available_formats():
        raise AudioError(f"cannot write {path}: use a .wav, .flac or .ogg file name")


def write_audio(path: str | Path, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write float samples, shape (n,) or (n, channels), as a 16-bit wav file."""
    pcm = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    try:
        sf.write(str(path), pcm, sample_rate, subtype="PCM_16")
    except (sf.LibsndfileError, RuntimeError, OSError) as exc:
        raise AudioError(f"cannot write {path}: {exc}") from None


# A wav file's sizes are 32-bit: its RIFF size counts the 36 header bytes after it plus the
# data, so one file holds at most this many bytes of samples (12.4 h of 16-bit stereo at 24 kHz).
WAV_MAX_DATA_BYTES = 0xFFFFFFFF - 36


def wav_header(sample_rate: int, channels: int, data_bytes: int | None) -> bytes:
    """The 44-byte header of a 16-bit PCM wav file holding `data_bytes` of samples; None: a
    stream of unknown length (both sizes at their maximum, as streaming servers send them)."""
    block_align = 2 * channels
    byte_rate = sample_rate * block_align
    fmt = struct.pack("<HHIIHH", 1, channels, sample_rate, byte_rate, block_align, 16)
    riff_size = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    data_size = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE")
    return (
        riff + struct.pack("<4sI", b"fmt ", len(fmt)) + fmt + b"data" + struct.pack("<I", data_size)
    )


class WavRecorder:
    """Streams frames of several channels into a new 16-bit wav file (e.g. user | Moshi).

    The header's sizes are rewritten every `sync_seconds`, so whatever ends the process (even
    `kill -9`) the file stays a valid wav holding everything up to the last sync. An existing
    file is never overwritten. A recording longer than one wav file can hold (`part_bytes` of
    samples) goes on in new files beside it: NAME.part2.wav, NAME.part3.wav, ... (the next
    number whose file does not exist yet); `paths` lists the files written.
    """

    def __init__(
        self,
        path: str | Path,
        channels: int,
        sample_rate: int = SAMPLE_RATE,
        sync_seconds: float = 1.0,
        part_bytes: int = WAV_MAX_DATA_BYTES,
    ):
        self.path = Path(path)
        self.channels = channels
        self.sample_rate = sample_rate
        self.paths: list[Path] = []
        self._sync_every = max(1, round(sync_seconds * sample_rate))
        self._part_frames = part_bytes // (2 * channels)
        self._open(self.path)

    def _open(self, path: Path) -> None:
        try:
            self._file = open(path, "xb", buffering=0)  # noqa: SIM115 - closed by close()
        except FileExistsError:
            raise AudioError(
                f"{path} already exists; give a new file name or remove it first"
            ) from None
        except OSError as exc:
            raise AudioError(f"cannot create recording {path}: {exc.strerror}") from None
        self._file.write(self._header(0))
        self.paths.append(path)
        self._frames = self._synced = 0

    def _next_part(self) -> None:
        """Close the full file and go on in the next free NAME.partN.wav."""
        self.close()
        number = len(self.paths) + 1
        while True:
            path = self.path.with_name(f"{self.path.stem}.part{number}{self.path.suffix}")
            if not path.exists():
                self._open(path)
                return
            number += 1

    def _header(self, data_bytes: int) -> bytes:
        return wav_header(self.sample_rate, self.channels, data_bytes)

    def write(self, *channels: np.ndarray) -> None:
        """Append one block: one (n,) array per channel."""
        block = np.clip(np.stack(channels, axis=1), -1.0, 1.0)
        samples = np.round(block * 32767).astype("<i2")
        while len(samples):
            room = self._part_frames - self._frames
            if room == 0:
                self._next_part()
                continue
            self._file.write(samples[:room].tobytes())
            self._frames += len(samples[:room])
            samples = samples[room:]
        if self._frames - self._synced >= self._sync_every:
            self._sync()

    def _sync(self) -> None:
        os.pwrite(self._file.fileno(), self._header(self._frames * 2 * self.channels), 0)
        self._synced = self._frames

    def close(self) -> None:
        if not self._file.closed:
            self._sync()
            self._file.close()
