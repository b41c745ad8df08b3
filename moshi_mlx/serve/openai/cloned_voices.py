"""Voices cloned from uploaded recordings, kept by content and named in later speech requests.

`POST /v1/audio/voices` takes a recording (any format libsndfile reads, at most 30 s) as the
request body; the server encodes it once into the TTS's audio prefix (Mimi's codes,
`TtsModel.voice_prefix`) and answers `{"id": "clone-...", "object": "audio.voice"}`. The id
is a hash of the codes, so the same recording uploaded again is the same voice and is not
stored twice; a `/v1/audio/speech` request names it as its `voice` (or `{"id": ...}`) and its
speech continues that recording's voice. The newest `MAX_VOICES` are kept, in memory only.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ID_PREFIX = "clone-"
MAX_VOICES = 64  # a prefix is at most 32 x 373 codes: 48 KB each


class ClonedVoices:
    """The audio prefixes of cloned voices by id, the newest `size` of them."""

    def __init__(self, size: int = MAX_VOICES):
        self.size = size
        self._prefixes: OrderedDict[str, np.ndarray] = OrderedDict()

    @staticmethod
    def id_of(prefix: np.ndarray) -> str:
        """The id of a prefix: a hash of its codes and shape."""
        digest = hashlib.sha256(repr(prefix.shape).encode() + prefix.tobytes()).hexdigest()
        return ID_PREFIX + digest[:24]

    def add(self, prefix: np.ndarray) -> str:
        """Keep `prefix` (codes (codebooks, frames)); its id."""
        prefix = np.ascontiguousarray(prefix, np.int32)
        voice_id = self.id_of(prefix)
        self._prefixes[voice_id] = prefix
        self._prefixes.move_to_end(voice_id)
        while len(self._prefixes) > self.size:
            self._prefixes.popitem(last=False)
        return voice_id

    def get(self, voice_id: str) -> np.ndarray | None:
        """The prefix of `voice_id`, or None (not a cloned voice's id, or forgotten)."""
        prefix = self._prefixes.get(voice_id)
        if prefix is not None:
            self._prefixes.move_to_end(voice_id)
        return prefix
