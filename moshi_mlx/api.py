"""`moshi_mlx.load`: the one way in. The config's model type says which model it is.

    import moshi_mlx

    model = moshi_mlx.load("kyutai/moshiko-mlx-q4")  # MoshiModel: Moshi, PersonaPlex, Hibiki
    model = moshi_mlx.load("kyutai/stt-1b-en_fr")  # SttModel
    model = moshi_mlx.load("~/models/tts-1.6b-en_fr")  # TtsModel, from a downloaded snapshot

Every kind loads through the one path of `moshi_mlx.runtime.loading`.
"""

from __future__ import annotations

from pathlib import Path

from moshi_mlx.chat.model import MoshiModel
from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
from moshi_mlx.errors import ConfigError
from moshi_mlx.runtime.loading import LoadOptions, load_parts
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.tts.synthesizer import TtsModel


def load(
    repo_or_folder: str | Path | None = None,
    *,
    voice_repo: str = DEFAULT_VOICE_REPO,
    n_q: int | None = None,
    **options: object,
) -> MoshiModel | SttModel | TtsModel:
    """Load the model of `repo_or_folder`, a Hugging Face repo id or a local folder laid out
    like one (default kyutai/moshiko-mlx-q4): a `MoshiModel` for the config's model type
    "moshi" (PersonaPlex included) or "hibiki", an `SttModel` for "stt", a `TtsModel` for
    "tts". The options, by name, are the fields of `moshi_mlx.runtime.loading.LoadOptions`;
    `voice_repo` is where a TTS model finds its voices (a hub repo id or a folder), `n_q` how
    many audio codebooks it generates (`TtsModel.n_q`; a TTS option only)."""
    chosen = LoadOptions.named(**options)
    repo = None if repo_or_folder is None else str(repo_or_folder)
    parts = load_parts(repo, chosen)
    model_type = parts.lm.cfg.model_type
    if model_type == "stt":
        return SttModel.from_parts(parts)
    if model_type == "tts":
        return TtsModel.from_parts(parts, voice_repo, n_q)
    if n_q is not None:
        raise ConfigError(f"n_q is a TTS option; this is a {parts.lm.cfg.model_name} model")
    return MoshiModel.from_parts(parts, chosen.codec_backend)
