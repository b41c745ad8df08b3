"""Voices for PersonaPlex: a name from the published set, a recording, or NVIDIA's `.pt`.

- A name (`NATF2`): one of the voices in the model's `voices.tgz` (NVIDIA's 18 `.pt` files),
  extracted once, member by member, and only regular files named `voices/<name>.pt`.
- A recording (`.wav`, `.flac`, ...): any rate and channel count, up to `MAX_VOICE_SECONDS`,
  mixed to mono, resampled to 24 kHz and normalized to -24 LUFS as NVIDIA's code does, then
  encoded with Mimi frame by frame (a fresh stream, zero-padded last frame).
- NVIDIA's `.pt` (a voice's input embeddings and delayed tokens, saved by its generator): read by
  `checkpoints.torch_zip`, which rebuilds tensors and nothing else, so a stranger's file
  cannot run code.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.chat.persona.prompt import VoicePrompt
from moshi_mlx.checkpoints.torch_zip import read_torch_file
from moshi_mlx.errors import AudioError, ConfigError, WeightsError
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE, Codec

MAX_VOICE_SECONDS = 30.0
MIN_VOICE_SECONDS = 0.5  # the loudness meter needs at least one 400 ms block
TARGET_LUFS = -24.0
DEFAULT_VOICE = "NATF2"
VOICE_SUFFIX = ".pt"
# NVIDIA's published voices (nvidia/personaplex-7b-v1's voices.tgz): natural and varied, female
# and male. A name outside them is unknown even when the archive cannot be had.
PUBLISHED_VOICES = tuple(
    f"{style}{sex}{index}"
    for style, count in (("NAT", 4), ("VAR", 5))
    for sex in "FM"
    for index in range(count)
)
_VOICE_MEMBER = re.compile(r"(?:\./)?voices/([A-Za-z0-9_-]+)\.pt")
_VOICE_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True)
class VoiceSource:
    """A voice as the user named it: `path` to read, `kind` "audio" or "pt", and `digest`,
    a hash of the file's bytes (what a cached prompt is keyed by)."""

    label: str
    path: Path
    kind: str
    digest: str


def is_voice_name(choice: str) -> bool:
    """Whether `--voice` names a published voice (a bare name: letters, digits, `_`, `-`)
    rather than a file (which has a suffix or a folder), whatever files exist."""
    return _VOICE_NAME.fullmatch(choice) is not None


def voice_names(archive: Path) -> list[str]:
    """The voices in a `voices.tgz`, sorted."""
    with _open_archive(archive) as tar:
        return sorted(m.group(1) for info in tar if (m := _voice_member(info)))


def _voice_member(info: tarfile.TarInfo) -> re.Match[str] | None:
    return _VOICE_MEMBER.fullmatch(info.name) if info.isreg() else None


def _open_archive(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise WeightsError(f"cannot read the voices archive {archive}: {exc}") from None


def unknown_voice(name: str, known: Iterable[str]) -> ConfigError:
    """The error for a voice name that is not among `known`."""
    return ConfigError(
        f"unknown voice {name!r}; the voices are {', '.join(sorted(known))} "
        "(or give a .wav or .pt file)"
    )


def archive_with_voice(name: str, find_archive: Callable[[], Path]) -> Path:
    """The voices archive (`find_archive()`) that should hold voice `name`; when it cannot be
    had (offline), `ConfigError` for a name NVIDIA never published rather than the archive's
    download error."""
    try:
        return find_archive()
    except WeightsError:
        if name not in PUBLISHED_VOICES:
            raise unknown_voice(name, PUBLISHED_VOICES) from None
        raise


def extract_voice(archive: Path, name: str, folder: Path) -> Path:
    """The `.pt` of voice `name` from `archive`, extracted into `folder` (once);
    `ConfigError` naming the known voices if there is no such voice."""
    target = folder / f"{name}{VOICE_SUFFIX}"
    if target.is_file():
        return target
    with _open_archive(archive) as tar:
        members = {m.group(1): info for info in tar if (m := _voice_member(info))}
        if name not in members:
            raise unknown_voice(name, members)
        data = tar.extractfile(members[name]).read()
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def existing_voice_file(choice: str | Path) -> Path:
    """The file a `--voice` names (`~` expanded); `ConfigError` if there is none."""
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(f"voice file not found: {path}")
    return path


def voice_source(path: Path, label: str | None = None) -> VoiceSource:
    """A voice file: `.pt` (NVIDIA's saved voice) or audio."""
    path = existing_voice_file(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    kind = "pt" if path.suffix.lower() == VOICE_SUFFIX else "audio"
    return VoiceSource(label or str(path), path, kind, digest)


def read_voice(source: VoiceSource, config: LmConfig, codec: Codec) -> VoicePrompt:
    """The voice prompt of `source` for a model of `config`; `codec` is a fresh Mimi stream
    (for recordings)."""
    if source.kind == "pt":
        return _read_saved_voice(source.path, config)
    return VoicePrompt(codes=encode_voice(load_voice_audio(source.path), codec))


def load_voice_audio(path: Path) -> np.ndarray:
    """A recording as NVIDIA's code feeds it: 24 kHz mono, -24 LUFS; one-line errors for a
    file too long, too short or silent."""
    import pyloudnorm

    pcm = read_audio(path, SAMPLE_RATE).astype(np.float64)
    seconds = len(pcm) / SAMPLE_RATE
    if seconds > MAX_VOICE_SECONDS:
        raise AudioError(
            f"the voice {path} is {seconds:.1f} s long; a voice prompt may be at most "
            f"{MAX_VOICE_SECONDS:.0f} s (10 s is plenty): cut it"
        )
    if seconds < MIN_VOICE_SECONDS:
        raise AudioError(f"the voice {path} is {seconds:.2f} s long; give at least 0.5 s")
    meter = pyloudnorm.Meter(SAMPLE_RATE)
    loudness = meter.integrated_loudness(pcm)
    if not np.isfinite(loudness):
        raise AudioError(f"the voice {path} is silent")
    with warnings.catch_warnings():  # pyloudnorm warns when the gain makes samples clip
        warnings.simplefilter("ignore")
        return pyloudnorm.normalize.loudness(pcm, loudness, TARGET_LUFS)


def encode_voice(pcm: np.ndarray, codec: Codec) -> np.ndarray:
    """Mimi codes (frames, num_codebooks) of `pcm`, frame by frame, the last zero-padded."""
    frames = -(-len(pcm) // FRAME_SIZE)
    padded = np.zeros(frames * FRAME_SIZE, np.float32)
    padded[: len(pcm)] = pcm
    codes = [codec.encode_step(frame) for frame in padded.reshape(frames, FRAME_SIZE)]
    stacked = mx.stack(codes)
    mx.eval(stacked)
    return np.array(stacked, dtype=np.int64)


def _read_saved_voice(path: Path, config: LmConfig) -> VoicePrompt:
    data = read_torch_file(path)
    if not isinstance(data, dict) or set(data) != {"embeddings", "cache"}:
        raise WeightsError(f"{path} is not a PersonaPlex voice (a dict of embeddings and cache)")
    embeddings, ring = np.asarray(data["embeddings"]), np.asarray(data["cache"])
    if embeddings.ndim != 4 or embeddings.shape[1:3] != (1, 1) or embeddings.shape[3] != config.dim:
        raise WeightsError(
            f"{path}: voice embeddings of shape {embeddings.shape}; this model needs "
            f"(frames, 1, 1, {config.dim})"
        )
    slots = config.max_delay + 3  # NVIDIA's delayed tokens
    if ring.shape != (1, config.num_codebooks, slots) or not np.issubdtype(ring.dtype, np.integer):
        raise WeightsError(
            f"{path}: voice's delayed tokens of shape {ring.shape}; this model needs "
            f"(1, {config.num_codebooks}, {slots}) integers"
        )
    if ring.min() < -2 or ring[0, 1:].max() > config.card or ring[0, 0].max() > config.text_card:
        raise WeightsError(f"{path}: voice's delayed tokens hold tokens outside the model's range")
    if len(embeddings) < 1 or not np.isfinite(embeddings).all():
        raise WeightsError(f"{path}: voice embeddings are empty or not finite")
    return VoicePrompt(embeddings=embeddings[:, 0, 0], ring=ring[0])
