"""A model's LM config, read and converted in one place.

`hub.find_config` finds a model's config.json (given, beside the LM weights, in a local repo
folder, in the weights folder, else the hub repo's) and `read_config` reads it, once, into a
`ConfigSource`: its keys name the model's other files (`moshi_name`, `mimi_name`,
`tokenizer_name`), as Kyutai's loaders read them. Once the LM file is open,
`ConfigSource.lm_config` converts it: the `LmConfig` given, else the config.json's, else the
one our LM files carry in their metadata, else the preset the file's layout says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from moshi_mlx.checkpoints.io import SafetensorsFile, read_safetensors
from moshi_mlx.checkpoints.spec import CONFIG_KEY
from moshi_mlx.errors import ConfigError, WeightsError
from moshi_mlx.models.config import MODEL_TYPES
from moshi_mlx.models.lm import LmConfig

# Depformer input projections, counted in either naming: how many steps a file stores.
_DEPFORMER_STEP = re.compile(r"(?:depformer_in\.|depformer\.slices\.)([0-9]+)[.]")


@dataclass(frozen=True)
class ConfigSource:
    """Where a model's LM config comes from: a config.json found and read (`path`, its keys
    `data`), an `LmConfig` given, both (the given config wins, the file names the files), or
    neither (the LM file says)."""

    path: Path | None = None
    data: dict | None = field(default=None, compare=False, repr=False)
    given: LmConfig | None = None

    @property
    def names(self) -> dict:
        """The config.json's keys (its `model_type` and the file names it gives); empty
        without one."""
        return self.data or {}

    def lm_config(self, lm_file: str | Path | SafetensorsFile) -> LmConfig:
        """The model's `LmConfig` for its LM file (a path, or the file opened): the one given,
        else the config.json's, else the one the file carries in its metadata (`CONFIG_KEY`),
        else the preset its layout says (a 16-step depformer: PersonaPlex 7B; else Moshi 7B)."""
        if self.given is not None:
            return self.given
        if self.data is not None:
            return LmConfig.from_dict(self.data)
        file = lm_file if isinstance(lm_file, SafetensorsFile) else read_safetensors(lm_file)
        if CONFIG_KEY in file.metadata:
            try:
                return LmConfig.from_dict(json.loads(file.metadata[CONFIG_KEY]))
            except ValueError:
                raise ConfigError(f"{file.path}: its metadata's LM config is not JSON") from None
        steps = {m.group(1) for name in file.tensors if (m := _DEPFORMER_STEP.match(name))}
        personaplex = LmConfig.personaplex_7b()
        return personaplex if len(steps) == personaplex.dep_q else LmConfig.moshi_7b()


def read_config(path: Path, given: LmConfig | None = None) -> ConfigSource:
    """The config.json at `path`, read (with the `LmConfig` `given`, if any); `WeightsError`
    if it is not JSON, `ConfigError` if its model is not one of the family."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{path} is not valid JSON: {exc}") from None
    if data.get("model_type", "moshi") not in MODEL_TYPES:
        raise ConfigError(_not_of_the_family(path, data))
    return ConfigSource(path, data, given)


def _not_of_the_family(config: Path, data: dict) -> str:
    """Why the model whose config.json is `config` (`data`) is not one `load` takes."""
    model_type = data.get("model_type")
    if "architectures" in data or (config.parent / "tokenizer_config.json").is_file():
        return (
            f"{config.parent} holds an LLM ({model_type!r}, for mlx-lm), not a model of the "
            "Moshi family: an LLM goes to `python -m moshi_mlx serve --llm` or `assistant "
            "--llm` (moshi_mlx.llm.LlmModel)"
        )
    return f"{config}: model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
