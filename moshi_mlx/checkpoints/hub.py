"""Finding a model's files: explicit paths, the local `weights/` folder, a repo's files.

A repo is a Hugging Face repo id (`kyutai/moshiko-mlx-q4`) or a local folder laid out like
one (a downloaded snapshot); `repo_file` is the one place that tells them apart. Each file is
looked up in this order: a path given by the user; for a hub repo, the weights folder
(`$MOSHI_MLX_WEIGHTS`, else `./weights`); the repo (a folder's file, or the hub's through
`hf_hub_download`, which uses and fills the usual Hugging Face cache).

The config.json comes first (`find_config`, read once by `lm_config.read_config`): its
`model_type` says which model the files are and names the other files (`moshi_name`,
`mimi_name`, `tokenizer_name`, as Kyutai's loaders read them, for every model type).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from moshi_mlx.checkpoints.io import read_safetensors
from moshi_mlx.checkpoints.lm_config import ConfigSource, read_config
from moshi_mlx.checkpoints.online import HubMiss, download
from moshi_mlx.checkpoints.spec import (
    CONFIG_FILE,
    DEFAULT_REPO,
    KNOWN_REPOS,
    LM_FILES,
    MIMI_FILE,
    PERSONAPLEX_REPO,
    PUBLISHERS,
    TOKENIZER_FILE,
    config_in,
)
from moshi_mlx.errors import ConfigError, Setting, WeightsError
from moshi_mlx.models.lm import LmConfig

_REPO_SUFFIX = re.compile(f"-({'|'.join(suffix for suffix, _ in LM_FILES.values())})$")
WEIGHTS_ENV = "MOSHI_MLX_WEIGHTS"


@dataclass(frozen=True)
class WeightFiles:
    """Local paths of everything a model needs and its config (`config.path` None: the LM
    file says it); `mimi` and `tokenizer` are None when only the LM was looked for."""

    moshi: Path
    mimi: Path | None
    tokenizer: Path | None
    config: ConfigSource = dataclasses.field(default_factory=ConfigSource)
    # The repo (hub id or folder) files not found locally come (or would come) from: not part
    # of equality.
    repo: str = dataclasses.field(default=DEFAULT_REPO, compare=False)


def weights_dir() -> Path:
    """The folder searched before the hub: `$MOSHI_MLX_WEIGHTS`, else `./weights`."""
    return Path(os.environ.get(WEIGHTS_ENV) or "weights")


def local_folder(repo: str) -> Path | None:
    """The folder `repo` names when it is a local path, None when it is a hub repo id;
    `WeightsError` for a path that is no folder (never a hub URL built from a path)."""
    path = Path(repo).expanduser()
    if path.is_dir():
        return path
    looks_like_path = repo.startswith(("/", ".", "~")) or repo.count("/") > 1 or path.exists()
    if looks_like_path:
        what = "is a file" if path.is_file() else "does not exist"
        raise WeightsError(
            f"the repo {repo} {what}: give a folder laid out like a Hugging Face repo, or a "
            "repo id (owner/name)"
        )
    return None


def is_local(repo: str) -> bool:
    """Whether `repo` is a local folder rather than a hub repo id."""
    return local_folder(repo) is not None


def repo_and_lm_file(hf_repo: str | None, quantize: int | None) -> tuple[str, str]:
    """The repo and LM file name for `hf_repo` / `quantize` (4, 8 or 16 = bf16); a local
    folder's LM file is, without `quantize`, the most precise it holds."""
    if quantize is not None and quantize not in LM_FILES:
        raise ConfigError(
            Setting("quantize"), f" must be 4, 8 or 16 (bf16), got {quantize}", parameter="quantize"
        )
    repo = hf_repo or DEFAULT_REPO
    folder = local_folder(repo)
    if folder is not None:
        if quantize is not None:
            return repo, LM_FILES[quantize][1]
        held = [LM_FILES[bits][1] for bits in sorted(LM_FILES, reverse=True)]
        return repo, next((name for name in held if (folder / name).is_file()), held[-1])
    facts = KNOWN_REPOS.get(repo)
    if facts is not None:
        bits = max(facts.lm_bits) if quantize is None else quantize
        if bits not in facts.lm_bits:
            raise ConfigError(
                f"{repo} publishes only {', '.join(LM_FILES[b][0] for b in facts.lm_bits)} "
                f"weights: make a "
                f"{LM_FILES[bits][0]} file with python -m moshi_mlx quantize and pass it as ",
                Setting("moshi_weight"),
                parameter="quantize",
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
        raise WeightsError(Setting(parameter, path), ": file not found", parameter=parameter)
    return path


def repo_file(repo: str, filename: str, parameter: str) -> Path:
    """`filename` of the repo `repo`: a local folder's file, or the Hugging Face repo's
    (cached); `WeightsError` naming the file (and where to put it by hand, or which `parameter` to
    pass) when it cannot be had."""
    folder = local_folder(repo)
    if folder is not None:
        if not (folder / filename).is_file():
            raise WeightsError(
                f"{folder} has no {filename} (or pass ",
                Setting(parameter, "PATH"),
                ")",
                parameter=parameter,
            )
        return folder / filename
    try:
        return download(repo, filename)
    except HubMiss as miss:
        raise WeightsError(
            *_missing(repo, filename, parameter, miss), parameter=parameter
        ) from None


def _missing(repo: str, filename: str, parameter: str, miss: HubMiss) -> tuple[str | Setting, ...]:
    """Why `filename` of the hub repo `repo` cannot be had, and what to do, in one line
    (message parts)."""
    # A repo id is also a relative path: a mistyped folder reads as a repo. Say so when the
    # hub has no such repo, or when its owner publishes none of the family's models.
    typo = miss.why == "no repo" or repo.split("/")[0] not in PUBLISHERS
    folder = f"there is no folder {repo} here, and " if typo else ""
    instead = (f"put it in {weights_dir()}/ (or pass ", Setting(parameter, "PATH"), ")")
    if miss.why == "no repo":
        hint = f"https://huggingface.co/{repo}; a private or gated one needs `hf auth login`"
        return (f"cannot get {filename}: {folder}there is no Hugging Face repo {repo} ({hint})",)
    if miss.why == "no file":
        return (f"the Hugging Face repo {repo} has no {filename}; ", *instead)
    if miss.why == "offline":
        # A model's repo is downloaded whole (its files are what it needs); a voice alone.
        command = f"hf download {repo}" + (f" {filename}" if parameter == "voice" else "")
        why = (
            f"cannot get {filename} from the Hugging Face repo {repo}: {folder}the hub cannot "
            f"be reached ({miss.detail}) and the file is not in the local cache; download it "
            f"when online (`{command}`, or from https://huggingface.co/{repo}), or "
        )
        return (why, *instead)
    why = (
        f"cannot get {filename} from the Hugging Face repo {repo} ({miss.detail}); download "
        f"it from https://huggingface.co/{repo} and "
    )
    return (why, *instead)


def find_config(
    repo: str | None,
    lm_config: str | Path | LmConfig | None = None,
    moshi_weight: str | Path | None = None,
    lm_file: str = LM_FILES[4][1],
    required: bool = False,
) -> ConfigSource:
    """A model's config, found and read (`lm_config.ConfigSource`; its `lm_config(lm_file)`
    is the `LmConfig`). `lm_config` a path: that config.json; an `LmConfig`: that config, the
    config.json still looked for as it names the files. Else Kyutai's config.json beside given
    LM weights, in a local repo folder, in the weights folder, else the hub repo's, when it
    publishes one in Kyutai's schema and its LM file (`lm_file`) is not already local; `repo`
    None (a lone LM file) looks no further than beside it. Without one (an error if
    `required`), the LM file says the rest."""
    given = lm_config if isinstance(lm_config, LmConfig) else None
    path = _config_path(repo, None if given else lm_config, moshi_weight, lm_file, required)
    return ConfigSource(given=given) if path is None else read_config(path, given)


def lm_config_of(lm_file: str | Path, lm_config: str | Path | LmConfig | None = None) -> LmConfig:
    """The `LmConfig` of a lone LM file (the quantizer's input, a test's fixture):
    `lm_config` (a config.json's path or an `LmConfig`), else the config.json beside the file,
    else what the file says (`find_config`, then `ConfigSource.lm_config`)."""
    return find_config(None, lm_config, lm_file).lm_config(lm_file)


def _config_path(
    repo: str | None,
    lm_config: str | Path | None,
    moshi_weight: str | Path | None,
    lm_file: str,
    required: bool,
) -> Path | None:
    """Where `find_config` finds the config.json (None: nowhere it looks)."""
    if lm_config is not None:
        return _user_path(lm_config, "lm_config")
    if moshi_weight is not None and (beside := config_in(Path(moshi_weight).expanduser().parent)):
        return beside
    if repo is None:
        return None
    folder = local_folder(repo)
    if folder is not None:
        return repo_file(repo, CONFIG_FILE, "lm_config") if required else config_in(folder)
    if local := config_in(weights_dir()):
        return local
    if required:
        return repo_file(repo, CONFIG_FILE, "lm_config")
    facts = KNOWN_REPOS.get(repo)
    lm_is_local = moshi_weight is not None or (weights_dir() / lm_file).is_file()
    if lm_is_local or (facts is not None and not facts.read_config):
        return None
    try:
        return repo_file(repo, CONFIG_FILE, "lm_config")
    except WeightsError:  # no config.json in the repo: the LM file says what it is
        return None


def resolve_weights(
    hf_repo: str | None = None,
    quantize: int | None = None,
    moshi_weight: str | Path | None = None,
    mimi_weight: str | Path | None = None,
    tokenizer: str | Path | None = None,
    lm_config: str | Path | LmConfig | None = None,
    default_repo: str = DEFAULT_REPO,
    config_required: bool = False,
    lm_only: bool = False,
) -> WeightFiles:
    """Find (downloading if needed) every file of a model; see the module docstring. The
    config is found first (`find_config`) and read once; its config.json names the files
    (`moshi_name`, `mimi_name`, `tokenizer_name`), else the defaults are Kyutai's; `quantize`
    picks the LM file of a Moshi repo. `lm_only`: the LM file alone (and its config)."""
    repo, lm_file = repo_and_lm_file(hf_repo or default_repo, quantize)
    # Check every given path before any (slow) download, so a typo fails at once: a file
    # given as weights must open as safetensors (its header only).
    given = {"moshi_weight": moshi_weight, "mimi_weight": mimi_weight, "tokenizer": tokenizer}
    for parameter, path in given.items():
        if path is not None:
            found = _user_path(path, parameter)
            if parameter != "tokenizer":
                read_safetensors(found, parameter)
    config = find_config(repo, lm_config, moshi_weight, lm_file, config_required)
    names = config.names  # a config.json names its files, whatever the model type, as Kyutai's
    if quantize is None and _names_lm_file(names, repo):
        lm_file = names.get("moshi_name", LM_FILES[16][1])
    wanted = {  # field: (file name in the repo, parameter, path given by the user)
        "moshi": (lm_file, "moshi_weight", moshi_weight),
        "mimi": (names.get("mimi_name", MIMI_FILE), "mimi_weight", mimi_weight),
        "tokenizer": (names.get("tokenizer_name", TOKENIZER_FILE), "tokenizer", tokenizer),
    }
    fields = ("moshi",) if lm_only else tuple(wanted)
    found = {
        field: _find_file(repo, *wanted[field]) if field in fields else None for field in wanted
    }
    return WeightFiles(config=config, repo=repo, **found)


def _names_lm_file(names: dict, repo: str) -> bool:
    """Whether the config.json `names` says the LM file: always for STT, TTS and Hibiki; for
    Moshi (whose repos hold several precisions, `quantize` picks one) when a local folder
    holds the file its `moshi_name` says."""
    if names.get("model_type", "moshi") != "moshi":
        return True
    folder = local_folder(repo)
    return folder is not None and "moshi_name" in names and (folder / names["moshi_name"]).is_file()


def _find_file(repo: str, filename: str, parameter: str, given: str | Path | None) -> Path:
    """The given path, else (for a hub repo) the weights folder's file, else the repo's."""
    if given is not None:
        return _user_path(given, parameter)
    local = weights_dir() / filename
    if not is_local(repo) and local.is_file():
        return local
    return repo_file(repo, filename, parameter)


VOICES_FILE = KNOWN_REPOS[PERSONAPLEX_REPO].voices


def resolve_voices(files: WeightFiles) -> Path:
    """PersonaPlex's voices archive: beside the LM weights, in the weights folder, in the
    files' repo folder, else from the hub (the files' repo if it publishes voices, else
    NVIDIA's)."""
    for folder in (files.moshi.parent, weights_dir()):
        if (folder / VOICES_FILE).is_file():
            return folder / VOICES_FILE
    facts = KNOWN_REPOS.get(files.repo)
    has_voices = is_local(files.repo) or (facts is not None and facts.voices)
    return repo_file(files.repo if has_voices else PERSONAPLEX_REPO, VOICES_FILE, "voice")
