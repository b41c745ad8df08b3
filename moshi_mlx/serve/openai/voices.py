"""The TTS voices a server offers: the names in its voice repo (a hub repo id or a folder laid
out like `kyutai/tts-voices`) and in the weights folder, for this model; OpenAI's voice names
stand for the default voice.

Only listed names are spoken: a client never names a file of the server's disk, and a name
outside the repo never starts a download.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from moshi_mlx.checkpoints.hub import local_folder, weights_dir
from moshi_mlx.models.config import LmConfig
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.tts.voices import DEFAULT_VOICE, resolve_voice, voice_file_name

log = logging.getLogger("moshi_mlx.serve")

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
        `ApiError` for any other."""
        name = DEFAULT_VOICE if voice in OPENAI_VOICES else voice
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
        if folder is not None:
            return _folder_files(folder)
        try:
            from huggingface_hub import HfApi

            return list(HfApi().list_repo_files(self.voice_repo))
        except Exception as exc:  # noqa: BLE001 - offline, unknown repo: what is cached
            log.warning("cannot list the voices of %s (%s)", self.voice_repo, type(exc).__name__)
            return _cached_hub_files(self.voice_repo)


def _folder_files(folder: Path) -> list[str]:
    """The `.safetensors` files under `folder`, as paths relative to it."""
    if not folder.is_dir():
        return []
    return [p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors")]


def _cached_hub_files(repo: str) -> list[str]:
    """The files of the hub repo `repo` in the local Hugging Face cache."""
    try:
        from huggingface_hub import scan_cache_dir

        cache = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache at all
        return []
    return [
        file.file_path.relative_to(revision.snapshot_path).as_posix()
        for cached in cache.repos
        if cached.repo_id == repo
        for revision in cached.revisions
        for file in revision.files
    ]
