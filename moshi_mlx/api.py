"""`moshi_mlx.load`: a model of the family from a repo or folder, the class its config's model
type says.

    import moshi_mlx

    model = moshi_mlx.load("kyutai/moshiko-mlx-q4")  # MoshiModel: Moshi, PersonaPlex, Hibiki
    model = moshi_mlx.load("kyutai/stt-1b-en_fr")  # SttModel
    model = moshi_mlx.load("~/models/tts-1.6b-en_fr")  # TtsModel, from a downloaded snapshot

Every kind is built by `moshi_mlx.runtime.loading.load_parts`.
"""

from __future__ import annotations

from pathlib import Path

from moshi_mlx.chat.model import MoshiModel
from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
from moshi_mlx.runtime.loading import LoadOptions, load_parts
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.tts.synthesizer import TtsModel


def load(
    repo_or_folder: str | Path | None = None,
    *,
    voice_repo: str | None = None,
    n_q: int | None = None,
    **options: object,
) -> MoshiModel | SttModel | TtsModel:
    """Load the model of `repo_or_folder`, a Hugging Face repo id or a local folder laid out
    like one (default kyutai/moshiko-mlx-q4).

    Args:
        repo_or_folder: the model's repo or folder; its config's model type says what it is.
        voice_repo: where a TTS model finds its voices, a hub repo id or a folder (default
            kyutai/tts-voices); a TTS option only.
        n_q: how many audio codebooks a TTS model generates (`TtsModel.n_q`); a TTS option
            only.
        **options: the fields of `moshi_mlx.runtime.loading.LoadOptions`, by name.

    Returns:
        A `MoshiModel` for the model type "moshi" (PersonaPlex included) or "hibiki", an
        `SttModel` for "stt", a `TtsModel` for "tts". `ConfigError` for an option that the
        model does not take (before any weight is read), or for a folder of another kind of
        model (an LLM: `serve --llm`).
    """
    chosen = LoadOptions.named(**options)
    repo = None if repo_or_folder is None else str(repo_or_folder)
    given = {"voice_repo": voice_repo, "n_q": n_q}
    parts = load_parts(repo, chosen, kind_options=[k for k, v in given.items() if v is not None])
    model_type = parts.lm.config.model_type
    if model_type == "stt":
        return SttModel.from_parts(parts)
    if model_type == "tts":
        return TtsModel.from_parts(parts, voice_repo or DEFAULT_VOICE_REPO, n_q)
    return MoshiModel.from_parts(parts, chosen.codec_backend)
