"""Finding Moshi's weight files: explicit paths, the local `weights/` folder, or the HF hub.

Each file is looked up in this order: a path given by the user; the weights folder
(`$MOSHI_MLX_WEIGHTS`, else `./weights`); the Hugging Face hub through `hf_hub_download`,
which uses (and fills) the usual Hugging Face cache.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from moshi_mlx.checkpoints.io import read_json
from moshi_mlx.checkpoints.spec import (
    CONFIG_FILE,
    DEFAULT_REPO,
    KNOWN_REPOS,
    LM_FILES,
    MIMI_FILE,
    PERSONAPLEX_REPO,
    TOKENIZER_FILE,
    config_in,
)
from moshi_mlx.errors import ConfigError, WeightsError

_REPO_SUFFIX = re.compile(f"-({'|'.join(suffix for suffix, _ in LM_FILES.values())})$")
WEIGHTS_ENV = "MOSHI_MLX_WEIGHTS"


@dataclass(frozen=True)
class WeightFiles:
    """Local paths of everything a Moshi model needs; `lm_config` is None for the 7B preset."""

    moshi: Path
    mimi: Path
    tokenizer: Path
    lm_config: Path | None
    # The hub repo files not found locally come (or would come) from: not part of equality.
    repo: str = dataclasses.field(default=DEFAULT_REPO, compare=False)


def weights_dir() -> Path:
    """The folder searched before the hub: `$MOSHI_MLX_WEIGHTS`, else `./weights`."""
    return Path(os.environ.get(WEIGHTS_ENV) or "weights")


def repo_and_lm_file(hf_repo: str | None, quantize: int | None) -> tuple[str, str]:
    """The hub repo and LM file name for `hf_repo` and `quantize` (4, 8 or 16 = bf16)."""
    if quantize is not None and quantize not in LM_FILES:
        raise ConfigError(f"quantize must be 4, 8 or 16 (bf16), got {quantize}")
    repo = hf_repo or DEFAULT_REPO
    facts = KNOWN_REPOS.get(repo)
    if facts is not None:
        bits = max(facts.lm_bits) if quantize is None else quantize
        if bits not in facts.lm_bits:
            raise ConfigError(
                f"{repo} publishes only {', '.join(LM_FILES[b][0] for b in facts.lm_bits)} "
                f"weights: make a "
                f"{LM_FILES[bits][0]} file with python -m moshi_mlx.quantize and pass it "
                "as moshi_weight"
            )
        return repo, LM_FILES[bits][1]
    if quantize is None:
        match = _REPO_SUFFIX.search(repo)
        suffix = match.group(1) if match else "q4"
        quantize = next(bits for bits, (s, _) in LM_FILES.items() if s == suffix)
    elif _REPO_SUFFIX.search(repo):
        repo = _REPO_SUFFIX.sub("-" + LM_FILES[quantize][0], repo)
    return repo, LM_FILES[quantize][1]


def _user_path(path: str | Path, parameter: str) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise WeightsError(f"{parameter}={path}: file not found")
    return path


def download_file(repo: str, filename: str, parameter: str) -> Path:
    """`filename` of the Hugging Face repo `repo` (cached); `WeightsError` saying where to put
    it by hand (or which `parameter` to pass) when it cannot be had."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repo/file, HTTP or disk errors
        reason = type(exc).__name__
        raise WeightsError(
            f"cannot get {filename} from the Hugging Face repo {repo} ({reason}: offline or not "
            f"downloaded); download it from https://huggingface.co/{repo} and put it in "
            f"{weights_dir()}/ (or pass {parameter}=PATH)"
        ) from None


def resolve_weights(
    hf_repo: str | None = None,
    quantize: int | None = None,
    moshi_weight: str | Path | None = None,
    mimi_weight: str | Path | None = None,
    tokenizer: str | Path | None = None,
    lm_config: str | Path | None = None,
) -> WeightFiles:
    """Find (downloading if needed) every file of a Moshi model; see the module docstring."""
    repo, lm_file = repo_and_lm_file(hf_repo, quantize)
    wanted = {  # field: (file name in the repo, flag, path given by the user)
        "moshi": (lm_file, "moshi_weight", moshi_weight),
        "mimi": (MIMI_FILE, "mimi_weight", mimi_weight),
        "tokenizer": (TOKENIZER_FILE, "tokenizer", tokenizer),
    }
    config = _user_path(lm_config, "lm_config") if lm_config is not None else None
    found, from_hub = _find_files(repo, wanted)
    if lm_config is None:
        config = _optional_config(repo, found["moshi"], from_hub)
    return WeightFiles(lm_config=config, repo=repo, **found)


def _optional_config(repo: str, moshi: Path, from_hub: bool) -> Path | None:
    """Kyutai's config.json next to the LM weights, in the weights folder, or on the hub."""
    local = config_in(moshi.parent) or config_in(weights_dir())
    facts = KNOWN_REPOS.get(repo)
    if local is not None or not from_hub or (facts is not None and not facts.read_config):
        return local
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, CONFIG_FILE))
    except Exception:  # noqa: BLE001 - no config.json in the repo: use the 7B preset
        return None


VOICES_FILE = KNOWN_REPOS[PERSONAPLEX_REPO].voices


def resolve_voices(files: WeightFiles) -> Path:
    """PersonaPlex's voices archive: beside the LM weights, in the weights folder, else from
    the hub (the files' repo if it publishes voices, else NVIDIA's)."""
    for folder in (files.moshi.parent, weights_dir()):
        if (folder / VOICES_FILE).is_file():
            return folder / VOICES_FILE
    facts = KNOWN_REPOS.get(files.repo)
    repo = files.repo if facts is not None and facts.voices else PERSONAPLEX_REPO
    return download_file(repo, VOICES_FILE, "voice")


def resolve_config_named(
    hf_repo: str,
    moshi_weight: str | Path | None = None,
    mimi_weight: str | Path | None = None,
    tokenizer: str | Path | None = None,
    lm_config: str | Path | None = None,
) -> WeightFiles:
    """The files of a repo whose `config.json` names them (`moshi_name`, `mimi_name`,
    `tokenizer_name`: Kyutai's STT and Hibiki repos): the config first (given, in the weights
    folder, or from the hub), then each file as `resolve_weights` finds it."""
    if lm_config is not None:
        config = _user_path(lm_config, "lm_config")
    else:
        config = config_in(weights_dir()) or download_file(hf_repo, CONFIG_FILE, "lm_config")
    names = read_json(config)
    wanted = {  # field: (file name in the repo, flag, path given by the user)
        "moshi": (names.get("moshi_name", LM_FILES[16][1]), "moshi_weight", moshi_weight),
        "mimi": (names.get("mimi_name", MIMI_FILE), "mimi_weight", mimi_weight),
        "tokenizer": (names.get("tokenizer_name", TOKENIZER_FILE), "tokenizer", tokenizer),
    }
    return WeightFiles(lm_config=config, repo=hf_repo, **_find_files(hf_repo, wanted)[0])


def _find_files(
    repo: str, wanted: dict[str, tuple[str, str, str | Path | None]]
) -> tuple[dict[str, Path], bool]:
    """Each wanted file (field: (name in the repo, flag, path given by the user)): the given
    path, else the weights folder's, else the hub's; and whether the LM file is the hub's."""
    # Check every given path before any (slow) download, so a typo fails at once.
    found = {
        field: _user_path(given, flag)
        for field, (_, flag, given) in wanted.items()
        if given is not None
    }
    from_hub = False
    for field, (filename, flag, _) in wanted.items():
        if field in found:
            continue
        local = weights_dir() / filename
        if local.is_file():
            found[field] = local
        else:
            found[field] = download_file(repo, filename, flag)
            from_hub = from_hub or field == "moshi"
    return found, from_hub
