"""`moshi_mlx.load`, the one way in: each model kind from a local folder laid out like its hub
repo, the compute dtype honoured, and the refusals of the one load path."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from tiny_moshi import (
    cached_tiny_hibiki,
    cached_tiny_hibiki_zero,
    cached_tiny_moshi,
    cached_tiny_personaplex,
    cached_tiny_stt,
    fast_codec,
    tiny_hibiki_zero_config,
)

import moshi_mlx
from moshi_mlx.checkpoints.hub import WEIGHTS_ENV
from moshi_mlx.checkpoints.spec import CONFIG_FILE, MIMI_FILE, TOKENIZER_FILE
from moshi_mlx.errors import ConfigError, WeightsError

TTS_FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
TTS_075_FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts_075"


def _repo_folder(folder: Path, files: dict[str, Path]) -> Path:
    """A folder laid out like a hub repo: each file (name in the repo: path) linked in."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        (folder / name).symlink_to(path)
    return folder


def _nvidia_config(path: Path, ours: Path) -> Path:
    """PersonaPlex's config.json as NVIDIA writes it: ours without our two keys."""
    data = json.loads(ours.read_text())
    del data["user_codebooks"], data["generator"]
    path.write_text(json.dumps(data))
    return path


def _folder_of(kind: str, root: Path, tmp_path_factory) -> Path:
    moshi = cached_tiny_moshi(tmp_path_factory)
    shared = {MIMI_FILE: moshi["mimi"], TOKENIZER_FILE: moshi["tokenizer"]}
    if kind == "moshi":
        return moshi["moshi"].parent  # written as the repo lays it out
    if kind == "personaplex":  # NVIDIA's config, and no voices.tgz
        files = cached_tiny_personaplex(tmp_path_factory)
        folder = _repo_folder(root, {**shared, "model.safetensors": files["moshi"]})
        _nvidia_config(folder / CONFIG_FILE, files["lm_config"])
        return folder
    if kind == "hibiki-zero":  # the published file names
        files = cached_tiny_hibiki_zero(tmp_path_factory)
        config = tiny_hibiki_zero_config()
        return _repo_folder(
            root,
            {
                config.moshi_name: files["moshi"],
                config.tokenizer_name: moshi["tokenizer"],
                config.mimi_name: moshi["mimi"],
                CONFIG_FILE: files["lm_config"],
            },
        )
    if kind == "hibiki":
        files = cached_tiny_hibiki(tmp_path_factory)
    elif kind == "stt":
        files = cached_tiny_stt(tmp_path_factory)
    else:  # "tts", "tts-0.75b": the fixtures' folder with a Mimi
        fixtures = TTS_FIXTURES if kind == "tts" else TTS_075_FIXTURES
        config = json.loads((fixtures / CONFIG_FILE).read_text())
        return _repo_folder(
            root,
            {
                CONFIG_FILE: fixtures / CONFIG_FILE,
                config["moshi_name"]: fixtures / "weights.safetensors",
                config["tokenizer_name"]: fixtures / "tokenizer.model",
                MIMI_FILE: moshi["mimi"],
            },
        )
    return _repo_folder(
        root, {**shared, "model.safetensors": files["moshi"], CONFIG_FILE: files["lm_config"]}
    )


# kind: (class, compute dtype asked for)
KINDS = {
    "moshi": (moshi_mlx.MoshiModel, "bfloat16"),
    "personaplex": (moshi_mlx.MoshiModel, "float32"),
    "hibiki": (moshi_mlx.MoshiModel, "float16"),
    "hibiki-zero": (moshi_mlx.MoshiModel, "bfloat16"),
    "stt": (moshi_mlx.SttModel, "bfloat16"),
    "tts": (moshi_mlx.TtsModel, "float16"),
    "tts-0.75b": (moshi_mlx.TtsModel, "bfloat16"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_loads_from_a_folder_laid_out_like_its_repo(
    kind, tmp_path, tmp_path_factory, monkeypatch
):
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "no_weights"))
    folder = _folder_of(kind, tmp_path / "repo", tmp_path_factory)
    cls, dtype = KINDS[kind]
    codec = "mlx" if kind.startswith("tts") else fast_codec()
    model = moshi_mlx.load(folder, dtype=dtype, codec_backend=codec)
    assert type(model) is cls
    assert model.files.moshi.parent == folder and model.files.repo == str(folder)
    floats = [p.dtype for _, p in tree_flatten(model.lm.parameters()) if p.dtype != mx.uint32]
    assert set(floats) == {getattr(mx, dtype)}
    assert model.memory is not None and model.memory.dtype == getattr(mx, dtype)
    if kind == "personaplex":  # recognised in NVIDIA's terms; an unknown voice is unknown
        assert model.lm.config.prompted and model.lm.config.num_user_codebooks == 8
        with pytest.raises(ConfigError, match="unknown voice 'NATX9'; the voices are NATF0"):
            model.prompts.source("NATX9")
        with pytest.raises(WeightsError, match=f"{folder} has no voices.tgz"):
            model.prompts.source("NATF2")  # a published voice: the archive is what is missing


@pytest.mark.parametrize("kind", ["moshi", "personaplex", "stt"])
def test_each_file_header_is_read_once(kind, tmp_path, tmp_path_factory, monkeypatch):
    """Each file is opened once (`mx.load`, lazily): the plan and the load run from what the
    LM file's header says, and its tensors are then read from that one opening."""
    monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "no_weights"))
    folder = _folder_of(kind, tmp_path / "repo", tmp_path_factory)
    reads: Counter = Counter()

    def counted(what: str, read):
        def counting(path, *args, **kwargs):
            reads[what, Path(path).resolve()] += 1
            return read(path, *args, **kwargs)

        return counting

    monkeypatch.setattr(mx, "load", counted("mx.load", mx.load))
    model = moshi_mlx.load(folder, codec_backend="mlx")
    lm_file, mimi_file = model.files.moshi.resolve(), model.files.mimi.resolve()
    assert reads == {("mx.load", lm_file): 1, ("mx.load", mimi_file): 1}


def test_each_kind_loads_through_its_own_class_and_refuses_another(tmp_path, tmp_path_factory):
    stt = _folder_of("stt", tmp_path / "stt", tmp_path_factory)
    assert type(moshi_mlx.SttModel.load(stt, codec_backend=fast_codec())) is moshi_mlx.SttModel
    with pytest.raises(ConfigError, match="is a Kyutai STT model, not a text-to-speech model"):
        moshi_mlx.TtsModel.load(stt)
    with pytest.raises(ConfigError, match="is a Kyutai STT model, not a chat"):
        moshi_mlx.MoshiModel.load(stt)


def test_a_bad_dtype_is_refused(tmp_path_factory):
    folder = cached_tiny_moshi(tmp_path_factory)["moshi"].parent
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16"):
        moshi_mlx.load(folder, dtype="int8")


@pytest.mark.parametrize(
    "loader",
    [moshi_mlx.load, moshi_mlx.MoshiModel.load, moshi_mlx.SttModel.load, moshi_mlx.TtsModel.load],
)
def test_every_loader_takes_the_load_options_by_name_and_refuses_others(loader):
    """One list of options (`LoadOptions`'), checked before any file is looked for."""
    with pytest.raises(ConfigError, match="^'quantise' is not a load option; the options are "):
        loader("no/such-repo", quantise=4)
    with pytest.raises(ConfigError, match="^dtype must be one of"):
        loader("no/such-repo", dtype="int8")


def test_dtype_flag_reaches_the_load_options():
    from moshi_mlx.cli.chat_flags import add_model_args
    from moshi_mlx.cli.common import load_options

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert load_options(parser.parse_args([])).compute_dtype is None
    options = load_options(parser.parse_args(["--dtype", "float16"]))
    assert options.compute_dtype == mx.float16


def test_import_errors_stays_light():
    code = (
        "import sys, moshi_mlx.errors; print('mlx' in sys.modules, 'moshi_mlx.api' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]


def test_an_option_the_model_does_not_take_is_refused_before_any_weight(
    tmp_path_factory, monkeypatch
):
    """`voice_repo=` for Moshi is refused, not ignored (issue 41.9), before a weight is read."""
    from moshi_mlx.runtime import loading

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loading, "load_strict", no_weights)
    folder = cached_tiny_moshi(tmp_path_factory)["moshi"].parent
    with pytest.raises(ConfigError, match="^voice_repo is a text-to-speech option; .* Moshi"):
        moshi_mlx.load(folder, voice_repo="kyutai/tts-voices")
    with pytest.raises(ConfigError, match="^n_q is a text-to-speech option"):
        moshi_mlx.load(folder, n_q=8)


def test_an_mlx_lm_folder_is_named_an_llm(tmp_path):
    """Not "has no tokenizer-e351c8d8-checkpoint125.safetensors" (issue 41.9)."""
    from moshi_mlx.testing.llm import write_tiny_llm

    folder = write_tiny_llm(tmp_path / "tiny-llm")
    with pytest.raises(ConfigError, match="holds an LLM .* `python -m moshi_mlx serve --llm`"):
        moshi_mlx.load(folder)


def test_a_moshi_folder_config_names_its_files(tmp_path, tmp_path_factory):
    """`tokenizer_name`, `mimi_name`, `moshi_name` of a Moshi-type config.json are read as for
    the other types (it failed with "has no tokenizer_spm_32k_3.model")."""
    import shutil

    files = cached_tiny_moshi(tmp_path_factory)
    folder = tmp_path / "moshi"
    folder.mkdir()
    names = {"moshi": "lm.safetensors", "mimi": "codec.safetensors"}
    names["tokenizer"] = "tokenizer_spm_tiny_2000.model"
    for part, name in names.items():
        shutil.copy(files[part], folder / name)
    config = json.loads(files["lm_config"].read_text())
    config.update(moshi_name=names["moshi"], mimi_name=names["mimi"])
    config.update(tokenizer_name=names["tokenizer"])
    (folder / "config.json").write_text(json.dumps(config))
    model = moshi_mlx.load(folder, codec_backend=fast_codec())
    assert model.files.tokenizer == folder / names["tokenizer"]
    assert (model.files.moshi, model.files.mimi) == (
        folder / names["moshi"],
        folder / names["mimi"],
    )
