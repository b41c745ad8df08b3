"""Voices: Kyutai's speaker embeddings, found by name in `kyutai/tts-voices` or given as files.

A voice file is a safetensors file holding `speaker_wavs` (1, dim, frames) float32 (published:
(1, 512, 125)), made for one model: the repo names it `{voice}.{sig}@{epoch}.safetensors` after
the model's `model_id`; its floats may be of any floating dtype (bf16, float16), as Kyutai's
loader takes them. Only safetensors are read, so a voice from a stranger never runs code. A
voice may also be given as that embedding itself (`VoiceEmbedding`, e.g. one a server's
client sent), never written to a file.
The model attends to up to `MAX_SPEAKERS` voices at once, each in its own slot of `frames`
positions; empty slots are masked (the conditioner's learned padding), as Kyutai's
`TTSModel.make_condition_attributes` builds them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from moshi_mlx.checkpoints.hub import local_folder, repo_file, weights_dir
from moshi_mlx.checkpoints.online import cached, hub_down
from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
from moshi_mlx.errors import TtsError, WeightsError, one_line
from moshi_mlx.models.config import LmConfig
from moshi_mlx.runtime.model_memo import ModelMemo, model_memo

if TYPE_CHECKING:
    from moshi_mlx.models.lm import Lm
    from moshi_mlx.modules.transformer import CrossKV

DEFAULT_VOICE = "expresso/ex03-ex01_happy_001_channel1_334s.wav"
MAX_SPEAKERS = 5
VOICE_TENSOR = "speaker_wavs"
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3", ".aiff", ".aif")


@dataclass(frozen=True, eq=False)
class VoiceEmbedding:
    """A voice given as its embedding, floats (1, dim, frames) as a voice file's
    `speaker_wavs`, not as a file. Kept (a read-only copy) with `key`, a hash of its dtype,
    shape and values, by which a model's `VoiceCache` knows it again: the same embedding given
    twice is projected once."""

    array: np.ndarray
    key: str = field(init=False)

    def __post_init__(self):
        array = np.array(self.array, order="C")  # a copy: the caller's may change, not this
        if not np.issubdtype(array.dtype, np.floating):
            raise TtsError(f"a voice embedding holds floats, not {array.dtype}")
        array.flags.writeable = False
        digest = hashlib.blake2b(f"{array.dtype.str} {array.shape}".encode(), digest_size=16)
        digest.update(array.data)
        object.__setattr__(self, "array", array)
        object.__setattr__(self, "key", digest.hexdigest())


Voice = str | Path | VoiceEmbedding  # a name in the voice repo, a file, or an embedding


def is_recording(voice: object) -> bool:
    """Whether a voice given by name may be a recording to clone (an audio file's name; a
    voice's name in the repo may end in .wav too, as `DEFAULT_VOICE`)."""
    return isinstance(voice, (str, Path)) and Path(voice).suffix.lower() in AUDIO_SUFFIXES


def voice_file_name(voice: str, config: LmConfig) -> str:
    """The name of `voice`'s embedding for this model in the voice repo."""
    if config.model_id is None:
        raise TtsError("the model's config.json has no model_id, so it names no voice files")
    return f"{voice}.{config.model_id.sig}@{config.model_id.epoch}.safetensors"


def resolve_voice(
    voice: str | Path, config: LmConfig, voice_repo: str = DEFAULT_VOICE_REPO
) -> Path:
    """A local `.safetensors` file as given, else the voice `voice` for this model: in the
    weights folder (laid out like the voice repo), else in `voice_repo` (a hub repo id,
    downloaded once by the Hugging Face cache, or a local folder)."""
    path = Path(voice).expanduser()
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise TtsError(f"voice file {path} not found")
        return path
    if path.is_file():
        raise TtsError(f"voice file {path} is not a .safetensors embedding")
    name = voice_file_name(str(voice), config)
    if (weights_dir() / name).is_file():
        return weights_dir() / name
    try:
        return repo_file(voice_repo, name, "voice")
    except WeightsError as exc:
        if str(voice) == DEFAULT_VOICE:  # no voice was chosen: say which file is needed
            raise TtsError(
                f"no voice was given, and the default voice ({DEFAULT_VOICE}) is not here: ",
                *exc.parts,
                "; or give a voice (.safetensors file)",
                parameter="voice",
            ) from None
        if is_recording(voice):  # a recording to clone, not found: say so first
            what = f"voice {voice!r} is no audio file here (a recording to clone), nor a voice: "
            raise TtsError(what, *exc.parts, parameter="voice") from None
        raise TtsError(f"voice {voice!r}: ", *exc.parts, parameter="voice") from None


def default_voice_status(config: LmConfig, voice_repo: str = DEFAULT_VOICE_REPO) -> str:
    """One line for a server's start-up: where the default voice's file is, or that it will
    be downloaded on first use, or (the hub cannot be reached) how to download it."""
    name = voice_file_name(DEFAULT_VOICE, config)
    folder = local_folder(voice_repo)
    where = (weights_dir() / name, folder / name if folder else cached(voice_repo, name))
    local = next((path for path in where if path is not None and path.is_file()), None)
    if local is not None:
        return f"the default voice ({DEFAULT_VOICE}) is local: {local}"
    if folder is not None:
        return f"the default voice's file {name} is neither in {folder} nor in {weights_dir()}/"
    if (down := hub_down()) is not None:
        return (
            f"the default voice ({DEFAULT_VOICE}) is not downloaded and the hub cannot be "
            f"reached ({down}): `hf download {voice_repo} {name}` when online"
        )
    return f"the default voice ({DEFAULT_VOICE}) will be downloaded from {voice_repo} on first use"


def load_voice(path: str | Path, dim: int) -> mx.array:
    """The embedding (frames, dim) float32 of a voice file (any floating dtype, cast as
    Kyutai's loader does); `TtsError` naming what is wrong."""
    try:
        tensors = mx.load(str(path), format="safetensors")
    except (OSError, RuntimeError, ValueError) as exc:
        raise TtsError(
            f"voice file {path} is not a readable safetensors file: {one_line(exc)}"
        ) from None
    if VOICE_TENSOR not in tensors:
        raise TtsError(f"voice file {path} holds no {VOICE_TENSOR!r} tensor")
    return _model_embedding(tensors[VOICE_TENSOR], dim, f"voice file {path}: {VOICE_TENSOR}")


def _model_embedding(embedding: mx.array, dim: int, what: str) -> mx.array:
    """`embedding` (1, dim, frames) of any floating dtype as the model takes it: (frames, dim)
    float32; `TtsError` beginning with `what` when it is not that."""
    shape = embedding.shape
    if embedding.ndim != 3 or shape[0] != 1 or shape[1] != dim or shape[2] < 1:
        raise TtsError(
            f"{what} has shape {list(shape)}, this model needs [1, {dim}, frames] with at "
            "least one frame"
        )
    if not mx.issubdtype(embedding.dtype, mx.floating):
        raise TtsError(f"{what} must hold finite floats")
    embedding = embedding[0].T.astype(mx.float32)
    if not mx.isfinite(embedding).all().item():
        raise TtsError(f"{what} must hold finite floats")
    return embedding


def check_speakers(rows: Sequence[Sequence[object]]) -> None:
    """`TtsError` unless each batch row has 1 to `MAX_SPEAKERS` voices."""
    for voices in rows:
        if not 1 <= len(voices) <= MAX_SPEAKERS:
            raise TtsError(f"a request takes 1 to {MAX_SPEAKERS} voices, got {len(voices)}")


def speaker_condition(
    rows: Sequence[Sequence[mx.array]], frames: int | None = None
) -> tuple[mx.array, mx.array]:
    """Each batch row's voices ((frames, dim) each, 1 to `MAX_SPEAKERS`) as the tensor
    condition (B, MAX_SPEAKERS * frames, dim) and its mask (B, MAX_SPEAKERS * frames), each
    slot `frames` long (None: the longest voice's)."""
    check_speakers(rows)
    longest = max(voice.shape[0] for voices in rows for voice in voices)
    frames = longest if frames is None else max(frames, longest)
    dim = rows[0][0].shape[1]
    tensors, masks = [], []
    for voices in rows:
        slots = np.zeros((MAX_SPEAKERS, frames, dim), np.float32)
        mask = np.zeros((MAX_SPEAKERS, frames), bool)
        for slot, voice in enumerate(voices):
            slots[slot, : voice.shape[0]] = np.array(voice)
            mask[slot, : voice.shape[0]] = True
        tensors.append(slots.reshape(-1, dim))
        masks.append(mask.reshape(-1))
    return mx.array(np.stack(tensors)), mx.array(np.stack(masks))


def voice_keys_values(
    lm: Lm,
    rows: Sequence[Sequence[mx.array]],
    empty_voice_memo: ModelMemo[list[CrossKV]] | None = None,
    frames: int | None = None,
) -> list[CrossKV]:
    """Each temporal layer's cross-attention keys and values (B, H, MAX_SPEAKERS * frames,
    head_dim) for each batch row's voices, as `Lm.cross_keys_values` of `speaker_condition`
    (slots of `frames`; None: the longest voice's).

    The slots no row fills hold the conditioner's learned padding at fixed positions, the same
    for every request: their keys and values are computed once per voice length and kept in
    `empty_voice_memo` (the model's; None: computed for this call), and only the filled
    slots' are computed per request (one voice: a fifth of the work, which on a CPU is most
    of the time to the first audio).
    """
    tensor, mask = speaker_condition(rows, frames)
    total = tensor.shape[1]
    filled = max(len(voices) for voices in rows) * (total // MAX_SPEAKERS)
    if filled == total or tuple(lm.config.fuser.cross) != (VOICE_TENSOR,):
        return lm.cross_keys_values({VOICE_TENSOR: (tensor, mask)})

    def empty_keys_values() -> list[CrossKV]:
        empty = mx.zeros((1, total, tensor.shape[2]), tensor.dtype)
        keys_values = lm.cross_keys_values({VOICE_TENSOR: (empty, mx.zeros((1, total), mx.bool_))})
        mx.eval(keys_values)
        return keys_values

    padding = model_memo(lm, empty_voice_memo, size=None).get(total, empty_keys_values)
    # Positions 0..filled-1 get the same position embedding in a shorter source.
    voiced = lm.cross_keys_values({VOICE_TENSOR: (tensor[:, :filled], mask[:, :filled])})

    def joined(part: mx.array, padding: mx.array) -> mx.array:
        padding = padding[:, :, filled:]
        padding = mx.broadcast_to(padding, (part.shape[0], *padding.shape[1:]))
        return mx.concatenate([part, padding], axis=2)

    return [
        (joined(keys, empty_keys), joined(values, empty_values))
        for (keys, values), (empty_keys, empty_values) in zip(voiced, padding)
    ]


# Voices whose cross-attention keys and values a model keeps (a server's few voices), the
# least recently used dropped first.
VOICES_KEPT = 4


def voice_file_identity(path: Path) -> Hashable:
    """What tells a voice file from any other, and from itself rewritten, without reading it:
    its path and its file system record (device, inode, size, modification and change times)."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise TtsError(f"voice file {path} cannot be read: {exc.strerror}") from None
    times = (stat.st_mtime_ns, stat.st_ctime_ns)
    return (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, *times)


class VoiceCache:
    """What a TTS model keeps of the voices its requests name, so that a request in a voice
    used lately reads no voice file and projects nothing: per voice file (or embedding given,
    by its `VoiceEmbedding.key`) its embedding, per request's voices (and slot length) the
    temporal layers' cross-attention keys and values (evaluated), the `size` most recently
    used kept; and the empty slots' keys and values per slot length (`voice_keys_values`).
    Voices are found as `resolve_voice` finds them, in `voice_repo`; a voice file rewritten is
    read again."""

    def __init__(self, lm: Lm, voice_repo: str = DEFAULT_VOICE_REPO, size: int = VOICES_KEPT):
        self.lm = lm
        self.voice_repo = voice_repo
        self.embeddings: ModelMemo[mx.array] = ModelMemo(lm, size * MAX_SPEAKERS)
        self.keys_values: ModelMemo[list[CrossKV]] = ModelMemo(lm, size)
        self.empty_slots: ModelMemo[list[CrossKV]] = ModelMemo(lm, size=None)

    def clear(self) -> None:
        """Forget every voice (the empty slots' keys and values, the same for all, are kept)."""
        self.embeddings.clear()
        self.keys_values.clear()

    def _source(self, voice: Voice) -> tuple[Path | VoiceEmbedding, Hashable]:
        """The voice's file (or embedding) and what it is kept by."""
        if isinstance(voice, VoiceEmbedding):
            return voice, ("embedding", voice.key)
        path = resolve_voice(voice, self.lm.config, self.voice_repo)
        return path, voice_file_identity(path)

    def embedding(self, voice: Voice) -> mx.array:
        """The voice's embedding (frames, dim) float32 (`load_voice`), read once per file
        (checked once per embedding given)."""
        return self._embedding(*self._source(voice))

    def _embedding(self, source: Path | VoiceEmbedding, identity: Hashable) -> mx.array:
        dim = self.lm.condition_provider.conditioners[VOICE_TENSOR].spec.dim

        def read() -> mx.array:
            if isinstance(source, VoiceEmbedding):
                given = mx.array(source.array.astype(np.float32))
                return _model_embedding(given, dim, "the voice embedding")
            return load_voice(source, dim)

        return self.embeddings.get(identity, read)

    def rows_keys_values(self, rows: Sequence[Sequence[Voice]]) -> list[CrossKV]:
        """`voice_keys_values` of each batch row's voices (names, files or embeddings), each
        row's made once per voices and slot length and kept."""
        check_speakers(rows)
        sources = [[self._source(voice) for voice in voices] for voices in rows]
        embeddings = [[self._embedding(*source) for source in voices] for voices in sources]
        frames = max(voice.shape[0] for voices in embeddings for voice in voices)
        per_row = [
            self._row_keys_values(tuple(identity for _, identity in voices), row, frames)
            for voices, row in zip(sources, embeddings)
        ]
        if len(per_row) == 1:
            return per_row[0]
        return [
            (mx.concatenate([keys for keys, _ in layer]), mx.concatenate([v for _, v in layer]))
            for layer in zip(*per_row)
        ]

    def _row_keys_values(
        self, identities: tuple[Hashable, ...], voices: list[mx.array], frames: int
    ) -> list[CrossKV]:
        def make() -> list[CrossKV]:
            keys_values = voice_keys_values(self.lm, [voices], self.empty_slots, frames)
            mx.eval(keys_values)
            return keys_values

        return self.keys_values.get((identities, frames), make)
