"""Ogg Opus streams of the chat protocol, through `sphn` (Kyutai's Rust Ogg/Opus binding).

Each direction of a connection is one Ogg stream that starts with its OpusHead page. The
reader turns a client's pages into the model's 80 ms frames; the writer turns Moshi's frames
into pages.
"""

from __future__ import annotations

import numpy as np
import sphn

from moshi_mlx.serve.chat.protocol import ProtocolError


class OpusFrameReader:
    """A client's Ogg Opus bytes in, whole frames of `frame_size` float32 samples out."""

    def __init__(self, sample_rate: int, frame_size: int):
        self._reader = sphn.OpusStreamReader(sample_rate)
        self._frame_size = frame_size
        self._pending = np.zeros(0, dtype=np.float32)

    def feed(self, ogg_bytes: bytes) -> list[np.ndarray]:
        """Decode some bytes (any split of the stream); `ProtocolError` if they are not Opus."""
        try:
            pcm = self._reader.append_bytes(ogg_bytes)
        except ValueError as exc:
            raise ProtocolError(f"undecodable Ogg Opus audio: {exc}") from None
        if pcm.size:
            self._pending = np.concatenate([self._pending, np.asarray(pcm, np.float32)])
        n_frames = len(self._pending) // self._frame_size
        if n_frames == 0:
            return []
        whole = n_frames * self._frame_size
        frames = list(self._pending[:whole].reshape(n_frames, self._frame_size))
        self._pending = self._pending[whole:]
        return frames


class OpusFrameWriter:
    """Moshi's frames in, Ogg Opus pages out (the first call's output starts with OpusHead)."""

    def __init__(self, sample_rate: int):
        self._writer = sphn.OpusStreamWriter(sample_rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        """Pages for one frame of float32 samples; may be empty while the encoder buffers."""
        return self._writer.append_pcm(np.asarray(pcm, dtype=np.float32))
