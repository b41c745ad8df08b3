"""The TTS voices a server offers: the names in its voice repo (a hub repo id or a folder laid
out like `kyutai/tts-voices`) and in the weights folder, for this model; OpenAI's voice names
stand for the default voice.

Only listed names are spoken: a client never names a file of the server's disk, and a name
outside the repo never starts a download.
"""

from __future__ import annotations

import threading
from pathlib import Path

from moshi_mlx.checkpoints.hub import local_folder, weights_dir
from moshi_mlx.checkpoints.online import repo_files
from moshi_mlx.models.config import LmConfig
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.tts.voices import (
    DEFAULT_VOICE,
    default_voice_status,
    resolve_voice,
    voice_file_name,
)

# OpenAI's built-in voices: each stands for our default voice.
OPENAI_VOICES = (
    "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable",
    "marin", "nova", "onyx", "sage", "shimmer", "verse",
)  # fmt: skip


class VoiceCatalog:
    """The voices of `voice_repo` (and the weights folder) for the model of `config`, listed
    once on first use. Its methods block (folder scans, a hub listing, a download): call them
    off the event loop and off the model thread."""

    def __init__(self, config: LmConfig, voice_repo: str):
        self.config = config
        self.voice_repo = voice_repo
        self._suffix = voice_file_name("", config)  # ".{sig}@{epoch}.safetensors"
        self._names: list[str] | None = None
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The voice names (sorted), as `TtsModel.voice` takes them."""
        with self._lock:
            if self._names is None:
                files = _folder_files(weights_dir()) + self._repo_files()
                self._names = sorted(
                    {f[: -len(self._suffix)] for f in files if f.endswith(self._suffix)}
                )
            return self._names

    def resolve(self, voice: str) -> Path:
        """The embedding file of `voice` (a listed name, or an OpenAI voice name); a 400
        `ApiError` for any other, a 503 for an OpenAI name while the default voice is not
        downloaded."""
        name = DEFAULT_VOICE if voice in OPENAI_VOICES else voice
        if name not in self.names() and name != voice:
            raise ApiError(
                503,
                f"voice {voice!r} stands for the default voice, which is not downloaded: "
                + default_voice_status(self.config, self.voice_repo),
                "voice",
                "voice_not_downloaded",
            )
        if name not in self.names():
            raise ApiError(
                400,
                f"unknown voice {voice[:100]!r}: GET /v1/audio/voices lists this server's voices",
                "voice",
                "voice_not_found",
            )
        return resolve_voice(name, self.config, self.voice_repo)

    def _repo_files(self) -> list[str]:
        folder = local_folder(self.voice_repo)
        return _folder_files(folder) if folder is not None else repo_files(self.voice_repo)


def _folder_files(folder: Path) -> list[str]:
    """The `.safetensors` files under `folder`, as paths relative to it."""
    if not folder.is_dir():
        return []
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors")]
