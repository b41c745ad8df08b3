"""The TTS voices a server offers: the names in its voice repo (a hub repo id or a folder laid
out like `kyutai/tts-voices`) and in the weights folder, for this model; OpenAI's voice names
stand for the default voice.

Every route that takes a voice from a client resolves it here (`/v1/audio/speech`,
`/api/tts_streaming`, `/v1/realtime`). Only listed names are spoken, given without their
embedding suffix (`expresso/ex03-ex01_happy_001_channel1_334s.wav`) or with it, as Unmute and
moshi-server send them (`unmute-prod-website/p329_022.wav.1e68beda@240.safetensors`): a client
never names a file of the server's disk (an absolute path, `..` and any other name are only
keys that match nothing), a folder's file whose real path lies outside that folder (a symlink
out) is not listed, and a name outside the repo never starts a download.
"""

from __future__ import annotations

import threading
from pathlib import Path

from moshi_mlx.checkpoints.hub import local_folder, repo_file, weights_dir
from moshi_mlx.checkpoints.online import repo_files
from moshi_mlx.errors import TtsError, WeightsError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.serve.logtext import capped
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.tts.voices import (
    DEFAULT_VOICE,
    default_voice_status,
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
        self._files: dict[str, Path | None] | None = None  # name -> local file (None: the hub's)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The voice names (sorted), as `TtsModel.voice` takes them."""
        return sorted(self._listed())

    def _listed(self) -> dict[str, Path | None]:
        """Each voice's name and its local file, the weights folder's first (as
        `resolve_voice` looks), or None for a file of the hub repo."""
        with self._lock:
            if self._files is None:
                folder = local_folder(self.voice_repo)
                files = _folder_files(folder) if folder else dict.fromkeys(self._hub_files())
                files.update(_folder_files(weights_dir()))
                self._files = {
                    name[: -len(self._suffix)]: path
                    for name, path in files.items()
                    if name.endswith(self._suffix)
                }
            return self._files

    def resolve(self, voice: str) -> Path:
        """The embedding file of `voice` (a listed name with or without its embedding suffix,
        or an OpenAI voice name); a 400 `ApiError` for any other, a 503 for an OpenAI name
        while the default voice is not downloaded."""
        name = DEFAULT_VOICE if voice in OPENAI_VOICES else voice.removesuffix(self._suffix)
        files = self._listed()
        if name not in files and voice in OPENAI_VOICES:
            raise ApiError(
                503,
                f"voice {voice!r} stands for the default voice, which is not downloaded: "
                + default_voice_status(self.config, self.voice_repo),
                "voice",
                "voice_not_downloaded",
            )
        if name not in files:
            raise ApiError(
                400,
                f"unknown voice {capped(voice)!r}: GET /v1/audio/voices lists this server's voices",
                "voice",
                "voice_not_found",
            )
        path = files[name]
        if path is not None:
            return path
        try:  # a file of the hub repo, downloaded once (never the weights folder's unlisted one)
            return repo_file(self.voice_repo, voice_file_name(name, self.config), "voice")
        except WeightsError as exc:
            raise TtsError(f"voice {name!r}: ", *exc.parts, parameter="voice") from None

    def _hub_files(self) -> list[str]:
        return [f for f in repo_files(self.voice_repo) if ".." not in f.split("/")]


def _folder_files(folder: Path) -> dict[str, Path]:
    """The `.safetensors` files under `folder` whose real path lies in it, by their path
    relative to it. In a Hugging Face cache's snapshot (`.../snapshots/REV`), whose files link
    to `../../blobs/`, the repo's cache folder is what they must lie in."""
    if not folder.is_dir():
        return {}
    root = folder.resolve()
    if root.parent.name == "snapshots":
        root = root.parent.parent
    return {
        path.relative_to(folder).as_posix(): path
        for path in folder.rglob("*.safetensors")
        if path.resolve().is_relative_to(root) and path.is_file()
    }
