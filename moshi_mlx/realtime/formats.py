"""The audio formats of OpenAI's Realtime API: `audio/pcm` (16-bit little-endian at 24 kHz, the
models' rate) and G.711 `audio/pcmu` / `audio/pcma` (8 kHz telephony, resampled to 24 kHz and
back); `FrameCutter` cuts a client's chunks of any length into the models' 80 ms frames."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moshi_mlx.audio.resample import resample
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE

PCM, PCMU, PCMA = "audio/pcm", "audio/pcmu", "audio/pcma"
TELEPHONY_RATE = 8000
_MU = 255.0


@dataclass(frozen=True)
class AudioFormat:
    """One of the Realtime API's formats (`type` as its session config names it)."""

    type: str = PCM

    @property
    def rate(self) -> int:
        return SAMPLE_RATE if self.type == PCM else TELEPHONY_RATE

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.type == PCM else 1

    def as_dict(self) -> dict:
        """The format as the session config shows it."""
        return {"type": PCM, "rate": SAMPLE_RATE} if self.type == PCM else {"type": self.type}

    def decode(self, data: bytes) -> np.ndarray:
        """`data` (whole samples) as float32 samples at 24 kHz."""
        if self.type == PCM:
            return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
        codes = np.frombuffer(data, np.uint8)
        pcm = _mulaw_decode(codes) if self.type == PCMU else _alaw_decode(codes)
        return resample(pcm, TELEPHONY_RATE, SAMPLE_RATE)

    def encode(self, pcm: np.ndarray) -> bytes:
        """Float32 samples at 24 kHz as this format's bytes."""
        if self.type == PCM:
            return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        low = np.clip(resample(pcm, SAMPLE_RATE, TELEPHONY_RATE), -1.0, 1.0)
        codes = _mulaw_encode(low) if self.type == PCMU else _alaw_encode(low)
        return codes.tobytes()


def parse_format(value: object) -> AudioFormat:
    """A session config's `format` (`{"type": ..., "rate": 24000}`); ValueError otherwise."""
    if not isinstance(value, dict) or value.get("type") not in (PCM, PCMU, PCMA):
        raise ValueError(f"format must be {{'type': one of {PCM}, {PCMU}, {PCMA}}}")
    if value["type"] == PCM and value.get("rate", SAMPLE_RATE) != SAMPLE_RATE:
        raise ValueError(f"{PCM} is served at rate {SAMPLE_RATE} only")
    return AudioFormat(value["type"])


class FrameCutter:
    """Samples of any count in (`add`), whole 80 ms frames out; `rest` pads the remainder."""

    def __init__(self) -> None:
        self._pending = np.zeros(0, np.float32)

    def add(self, pcm: np.ndarray) -> list[np.ndarray]:
        pending = np.concatenate([self._pending, pcm.astype(np.float32)])
        whole = len(pending) // FRAME_SIZE * FRAME_SIZE
        self._pending = pending[whole:]
        return list(pending[:whole].reshape(-1, FRAME_SIZE))

    def rest(self) -> np.ndarray | None:
        """The samples held back, padded with silence to a frame (None if there are none)."""
        if not len(self._pending):
            return None
        frame = np.zeros(FRAME_SIZE, np.float32)
        frame[: len(self._pending)] = self._pending
        self._pending = np.zeros(0, np.float32)
        return frame

    def clear(self) -> None:
        self._pending = np.zeros(0, np.float32)


def _mulaw_decode(codes: np.ndarray) -> np.ndarray:
    value = ~codes.astype(np.int32) & 0xFF
    sign = value & 0x80
    exponent = (value >> 4) & 0x07
    mantissa = value & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return (np.where(sign, -magnitude, magnitude) / 32768.0).astype(np.float32)


def _mulaw_encode(pcm: np.ndarray) -> np.ndarray:
    sample = np.clip((pcm * 32768.0).astype(np.int32), -32635, 32635)
    sign = np.where(sample < 0, 0x80, 0)
    magnitude = np.abs(sample) + 0x84
    exponent = np.clip(np.floor(np.log2(magnitude)).astype(np.int32) - 7, 0, 7)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def _alaw_decode(codes: np.ndarray) -> np.ndarray:
    value = codes.astype(np.int32) ^ 0x55
    sign = value & 0x80
    exponent = (value >> 4) & 0x07
    mantissa = value & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return (np.where(sign, magnitude, -magnitude) / 32768.0).astype(np.float32)


def _alaw_encode(pcm: np.ndarray) -> np.ndarray:
    sample = np.clip((pcm * 32768.0).astype(np.int32), -32767, 32767)
    sign = np.where(sample >= 0, 0x80, 0)
    magnitude = np.abs(sample)
    exponent = np.clip(np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 7, 0, 7)
    shift = np.where(exponent == 0, 4, exponent + 3)
    mantissa = (magnitude >> shift) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)
