"""Voices cloned from uploaded recordings, kept by content and named in later speech requests.

`POST /v1/audio/voices` takes a recording (any format libsndfile reads, at most 30 s) as the
request body; the server encodes it once into the TTS's audio prefix (Mimi's codes,
`TtsModel.voice_prefix`) and answers `{"id": "clone-...", "object": "audio.voice"}`. The id
is a hash of the codes, so the same recording uploaded again is the same voice and is not
stored twice. Every route that takes a TTS voice by name resolves it here first
(`ClonedVoices.resolve`: `/v1/audio/speech`'s `voice`, `/api/tts_streaming`'s `?voice=` and
`{text, voice}`, a `/v1/realtime` session's voice), and a clone's speech continues that
recording's voice. A TTS of cloned voices only (no voice embeddings: tts-0.75b-en-public)
takes nothing else (`ClonedVoices.clone_prefix`). The newest `MAX_VOICES` are kept, in memory
only (the server's `ServeContext.cloned_voices`, one for all routes).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from moshi_mlx.errors import TtsError
from moshi_mlx.tts.voices import DEFAULT_VOICE

ID_PREFIX = "clone-"
MAX_VOICES = 64  # a prefix is at most 32 x 373 codes: 48 KB each
CLONED_VOICES_ONLY = (
    "this model speaks in cloned voices only: upload a recording to POST /v1/audio/voices and "
    "give its id as the voice"
)


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

    def resolve(self, voice: str) -> tuple[str, np.ndarray | None]:
        """What a request naming `voice` speaks in: for a cloned voice's id, the default
        voice's name (its speaker embedding) and the clone's audio prefix; for any other name,
        itself and None. `TtsError` (parameter "voice") for a cloned voice's id this server
        does not keep (never made here, or forgotten)."""
        if not voice.startswith(ID_PREFIX):
            return voice, None
        prefix = self._prefixes.get(voice)
        if prefix is None:
            raise TtsError(
                f"unknown cloned voice {voice[:64]!r}: this server keeps the newest {self.size} "
                "voices made by POST /v1/audio/voices, in memory; upload the recording again",
                parameter="voice",
            )
        self._prefixes.move_to_end(voice)
        return DEFAULT_VOICE, prefix

    def clone_prefix(self, voice: str | None) -> np.ndarray:
        """The audio prefix of the cloned voice `voice` (its id), for a TTS of cloned voices
        only. `TtsError` (parameter "voice"): `CLONED_VOICES_ONLY` for any other voice or none,
        `resolve`'s for an id this server does not keep."""
        prefix = self.resolve(voice)[1] if voice else None
        if prefix is None:
            raise TtsError(CLONED_VOICES_ONLY, parameter="voice")
        return prefix
