"""Audio prefixes: speech a TTS request continues, so that it speaks in that voice (Kyutai's
voice cloning with an audio prefix, `moshi` 0.2.13 `TTSModel.generate(prefixes=...)`).

A prefix is Mimi's codes of a recording (codebooks, frames). While it lasts, the text fed is
"no input" and the text schedule waits; each codebook k is forced to the prefix's codes
`delays[k] + delay_steps` steps late, replacing what the depformer sampled (the depformer's
own chain of slices saw its samples; the next steps read the prefix). The audio played starts
after the prefix's frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.errors import AudioError, Setting, TtsError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.mimi import Mimi
from moshi_mlx.runtime.codec import SAMPLE_RATE
from moshi_mlx.tts.voices import DEFAULT_VOICE, Voice, is_recording

MAX_PREFIX_SECONDS = 30.0  # a voice is a few seconds; each second costs 12.5 steps first
DROPPED_FRAMES = 2  # Kyutai's get_prefix drops the last 2 frames of the recording's codes


def split_recording(
    voices: Sequence[Voice], folder: Path | None = None
) -> tuple[tuple[Voice, ...], Path | None]:
    """A request's voices as `TtsRequest.voices` takes them (the default voice when none is
    left) and the recording among them whose voice it clones (None: none). A voice named like
    an audio file (`is_recording`) is a recording when that file exists (a relative path: in
    `folder`; None: the working folder), else a voice's name (Kyutai's end in .wav too).
    `TtsError` (parameter "voice") for more than one recording."""
    recordings, others = [], []
    for voice in voices:
        path = Path(voice).expanduser() if is_recording(voice) else None
        if path is not None and folder is not None and not path.is_absolute():
            path = folder / path
        if path is not None and path.is_file():
            recordings.append(path)
        else:
            others.append(voice)
    if len(recordings) > 1:
        raise TtsError(
            f"one recording to clone a voice from, not {len(recordings)}", parameter="voice"
        )
    return tuple(others) or (DEFAULT_VOICE,), recordings[0] if recordings else None


def clones_only(config: LmConfig) -> bool:
    """Whether the model of `config` speaks in cloned voices only: it attends to no voice
    embeddings (`cross_attention` off: tts-0.75b-en-public) and speaks in the voice of a
    recording it continues (an audio prefix)."""
    return not config.cross_attention


def check_recording(config: LmConfig, named: Sequence[Voice], recording: Path | None) -> None:
    """A model of cloned voices only (`clones_only`) speaks in the voice of a recording it
    continues: `TtsError` (parameter "voice") without one (naming a voice given like an audio
    file that is no file), or with `named` voices given by name or file beside it."""
    if not clones_only(config):
        return
    if recording is None:
        absent = [f"there is no file {voice}; " for voice in named if is_recording(voice)]
        raise TtsError(
            "this model clones the voice of a recording: ",
            *absent[:1],
            "give ",
            Setting("voice", "speech.wav"),
            " (a few seconds of speech; it has no named voices)",
            parameter="voice",
        )
    if named:
        raise TtsError(
            "this model takes one recording as its voice and no named voices", parameter="voice"
        )


def request_voices(
    voices: Sequence[Voice], config: LmConfig, mimi: Mimi
) -> tuple[tuple[Voice, ...], np.ndarray | None]:
    """What a request naming `voices` (names, embedding files, at most one recording) speaks
    in: the voices `TtsRequest.voices` takes (`split_recording`) and the audio prefix of the
    recording among them (`recording_codes`; None: none), checked for the model of `config`
    (`check_recording`). Runs Mimi: call it on the model thread."""
    voices = tuple(voices)
    named, recording = split_recording(voices)
    check_recording(config, named if len(voices) > (recording is not None) else (), recording)
    return named, None if recording is None else recording_codes(mimi, recording)


def recording_codes(mimi: Mimi, audio: str | Path | np.ndarray) -> np.ndarray:
    """Mimi's codes (codebooks, frames) of a recording (a file, or float32 mono samples at
    24 kHz) as Kyutai's `TTSModel.get_prefix` makes them: the whole recording encoded, its
    last 2 frames dropped. `AudioError` if it is longer than `MAX_PREFIX_SECONDS` or too
    short to leave a frame."""
    name = "the recording" if isinstance(audio, np.ndarray) else str(audio)
    pcm = audio if isinstance(audio, np.ndarray) else read_audio(audio, SAMPLE_RATE)
    pcm = np.asarray(pcm, np.float32).reshape(-1)
    seconds = len(pcm) / SAMPLE_RATE
    if seconds > MAX_PREFIX_SECONDS:
        raise AudioError(
            f"{name} lasts {seconds:.1f} s; a voice to clone is at most "
            f"{MAX_PREFIX_SECONDS:.0f} s (a few seconds are enough)"
        )
    codes = np.array(mimi.encode(mx.array(pcm)[None, None]))[0, :, :-DROPPED_FRAMES]
    if codes.shape[1] == 0:
        raise AudioError(f"{name} is too short to clone a voice from ({seconds:.2f} s)")
    return codes.astype(np.int32)


class AudioPrefixes:
    """The prefixes of a batch of requests (None: a request without one). `audio_start`
    (dep_q,): the step at which each codebook's audio starts (its delay plus the TTS's);
    `card`: the codes per codebook the LM reads (`TtsError` for a prefix's code outside)."""

    def __init__(
        self,
        prefixes: Sequence[np.ndarray | None],
        dep_q: int,
        audio_start: np.ndarray,
        card: int,
    ):
        self._codes: list[np.ndarray | None] = []
        for prefix in prefixes:
            if prefix is not None:
                prefix = np.asarray(prefix)
                if prefix.ndim != 2 or not prefix.shape[1] or prefix.dtype.kind not in "iu":
                    raise TtsError(
                        f"an audio prefix is integer codes (codebooks, frames), got "
                        f"{prefix.dtype} {prefix.shape}"
                    )
                prefix = prefix[:dep_q].astype(np.int64)
                if prefix.min() < 0 or prefix.max() >= card:  # the LM's tables have `card` codes
                    raise TtsError(
                        f"an audio prefix's codes are 0 to {card - 1} for this model, got "
                        f"{prefix.min()} to {prefix.max()}",
                        parameter="prefix",
                    )
                prefix = prefix.astype(np.int32)
            self._codes.append(prefix)
        self.dep_q = dep_q
        self.audio_start = np.asarray(audio_start)

    @classmethod
    def of(
        cls, prefixes: Sequence[np.ndarray | None], config: LmConfig, delay_steps: int
    ) -> AudioPrefixes:
        """The prefixes of a batch's requests for a model of `config` whose audio lags its
        text `delay_steps` steps (each codebook starts at its delay plus those)."""
        audio_start = np.array(config.delays[1:]) + delay_steps
        return cls(prefixes, config.dep_q, audio_start, config.card)

    def length(self, row: int) -> int:
        """Frames of row `row`'s prefix (0: none)."""
        codes = self._codes[row]
        return 0 if codes is None else codes.shape[1]

    def text_held(self, row: int, step: int) -> bool:
        """Whether row `row` still reads its prefix's text ("no input") at `step`."""
        return step < self.length(row)

    def replaced(self, step: int, codebooks: int) -> bool:
        """Whether every row's first `codebooks` audio tokens at `step` are its prefix's codes
        or "no input" (its codebook not started): whatever the depformer would sample then
        is replaced, so it need not run (its draws come from a key of their own)."""
        for prefix in self._codes:
            if prefix is None or prefix.shape[0] < codebooks:
                return False
            if step >= int(self.audio_start[:codebooks].min()) + prefix.shape[1]:
                return False
        return True

    def forced(self, step: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The audio codes and mask (B, dep_q) that replace step `step`'s samples, or None
        when no codebook of any row is forced then."""
        codes = np.zeros((len(self._codes), self.dep_q), np.int32)
        mask = np.zeros(codes.shape, bool)
        frame = step - self.audio_start  # (dep_q,): the prefix frame each codebook writes
        for row, prefix in enumerate(self._codes):
            if prefix is None:
                continue
            held = (frame >= 0) & (frame < prefix.shape[1])
            held[prefix.shape[0] :] = False
            codebooks = np.flatnonzero(held)
            codes[row, codebooks] = prefix[codebooks, frame[codebooks]]
            mask[row, codebooks] = True
        return (codes, mask) if mask.any() else None
