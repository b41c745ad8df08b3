"""The voice a spoken conversation of the server answers in: a `/v1/realtime` assistant
session's `session.audio.output.voice` and the `/assistant/` page's `?voice=`.

A voice is named as the TTS routes name one: a voice of the server's voice repo (an OpenAI
voice name stands for the default voice; `VoiceCatalog`) or a voice cloned by
`POST /v1/audio/voices` (its id; `ClonedVoices`). A TTS of cloned voices only (no voice
embeddings: tts-0.75b-en-public) takes a clone's id only, and has no default voice
(`ClonedVoices.clone_prefix`, `CLONED_VOICES_ONLY`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from moshi_mlx.errors import TtsError
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.serve.openai.voices import VoiceCatalog
from moshi_mlx.tts.synthesizer import DEFAULT_CFG_COEF, TtsStream
from moshi_mlx.tts.voices import DEFAULT_VOICE

# What a conversation speaks in: its voice's embedding (a file or the default voice's name;
# None: none, a TTS of cloned voices only) and a clone's audio prefix (None: none).
SpeakingVoice = tuple[Path | str | None, np.ndarray | None]


class ConversationVoices:
    """The voices of `context`'s TTS for conversations: `find` a name, `open` a stream in it."""

    def __init__(self, context: ServeContext):
        self._context = context
        tts = context.tts
        self.clones_only = tts.clones_only
        self._catalog = None
        if not self.clones_only:
            from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO

            repo = context.voice_repo or tts.voice_repo or DEFAULT_VOICE_REPO
            self._catalog = VoiceCatalog(tts.config, repo)

    async def find(self, name: str | None) -> SpeakingVoice:
        """The voice `name` names (a voice repo's, an OpenAI name, a clone's id; None: the
        default voice). `TtsError` (parameter "voice") for a voice the server does not offer
        (or the default voice while it is not downloaded), or, for a TTS of cloned voices
        only, anything but the id of a clone it keeps (`CLONED_VOICES_ONLY`)."""
        cloned = self._context.cloned_voices
        if self.clones_only:
            return None, cloned.clone_prefix(name)
        if not name:  # the TTS finds it (a voice downloaded since is found, not a listing's)
            return DEFAULT_VOICE, None
        name, prefix = cloned.resolve(name)
        try:
            return await asyncio.to_thread(self._catalog.resolve, name), prefix
        except ApiError as exc:
            raise TtsError(exc.message, parameter="voice") from None

    def open(self, voice: SpeakingVoice) -> TtsStream:
        """A TTS stream in `voice` (`find`'s), with the server's guidance; on the model
        thread."""
        voice_file, prefix = voice
        voices = () if voice_file is None else voice_file
        return self._context.tts.stream(voice=voices, cfg_coef=DEFAULT_CFG_COEF, prefix=prefix)
