"""Speech as OpenAI's `/v1/audio/speech` returns it: wav, pcm (16-bit little-endian mono),
Ogg Opus, FLAC or MP3, at 24 kHz, either as one file (`encode_speech`) or, for wav, pcm and
Opus, frame by frame as the model speaks (`SpeechStreamEncoder`).

A streamed wav's header gives both sizes at their maximum (its length is not known yet), as
OpenAI's does. FLAC and MP3 are not streamed: libsndfile writes their length (FLAC's sample
count, MP3's Xing frame) into their first bytes when the file ends, and without it libsndfile
itself cannot read them back.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
import sphn

from moshi_mlx.audio.wav import wav_header
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE

CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
SPEECH_FORMATS = tuple(CONTENT_TYPES)
STREAMED_FORMATS = ("wav", "pcm", "opus")
_SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}


def pcm16(pcm: np.ndarray) -> bytes:
    """Float samples as 16-bit little-endian integers."""
    return (np.clip(pcm, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


def encode_speech(response_format: str, pcm: np.ndarray) -> bytes:
    """The whole speech `pcm` (float32 at 24 kHz) as one file of `response_format`."""
    if response_format == "wav":
        samples = pcm16(pcm)
        return wav_header(SAMPLE_RATE, 1, len(samples)) + samples
    if response_format in _SOUNDFILE_FORMATS:
        file_format, subtype = _SOUNDFILE_FORMATS[response_format]
        buffer = io.BytesIO()
        sf.write(buffer, np.clip(pcm, -1.0, 1.0), SAMPLE_RATE, subtype, format=file_format)
        return buffer.getvalue()
    encoder = SpeechStreamEncoder(response_format)
    body = [encoder.start()]
    body += [encoder.encode(pcm[i : i + FRAME_SIZE]) for i in range(0, len(pcm), FRAME_SIZE)]
    return b"".join([*body, encoder.finish()])


class SpeechStreamEncoder:
    """80 ms frames of float32 speech in, the bytes of a `STREAMED_FORMATS` format out as soon
    as they are known: `start()` first (a wav's header), `encode(frame)` per frame, `finish()`."""

    def __init__(self, response_format: str):
        if response_format not in STREAMED_FORMATS:
            raise ValueError(f"{response_format} is not streamed")
        self.response_format = response_format
        self._opus = sphn.OpusStreamWriter(SAMPLE_RATE) if response_format == "opus" else None

    def start(self) -> bytes:
        return wav_header(SAMPLE_RATE, 1, None) if self.response_format == "wav" else b""

    def encode(self, pcm: np.ndarray) -> bytes:
        pcm = np.asarray(pcm, np.float32)
        if self._opus is not None:
            return self._opus.append_pcm(pcm)
        return pcm16(pcm)

    def finish(self) -> bytes:
        """The last bytes; an Opus stream gets one frame of silence, which pushes out the
        encoder's look-ahead (the end of the speech)."""
        if self._opus is not None:
            return self._opus.append_pcm(np.zeros(FRAME_SIZE, np.float32))
        return b""
