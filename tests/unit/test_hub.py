"""Where weights come from: path flags, the weights folder, the Hugging Face cache, offline."""

import struct
import subprocess
import sys

import pytest

from moshi_mlx.checkpoints import hub
from moshi_mlx.checkpoints.lm_config import ConfigSource
from moshi_mlx.errors import ConfigError, WeightsError

NAMES = (hub.MIMI_FILE, hub.TOKENIZER_FILE)


@pytest.mark.parametrize(
    ("repo", "bits", "expected"),
    [
        (None, None, ("kyutai/moshiko-mlx-q4", "model.q4.safetensors")),
        (None, 8, ("kyutai/moshiko-mlx-q8", "model.q8.safetensors")),
        (None, 16, ("kyutai/moshiko-mlx-bf16", "model.safetensors")),
        ("kyutai/moshika-mlx-q4", None, ("kyutai/moshika-mlx-q4", "model.q4.safetensors")),
        ("kyutai/moshika-mlx-q4", 8, ("kyutai/moshika-mlx-q8", "model.q8.safetensors")),
        ("kyutai/moshika-mlx-bf16", None, ("kyutai/moshika-mlx-bf16", "model.safetensors")),
        ("me/my-moshi", 8, ("me/my-moshi", "model.q8.safetensors")),
        ("nvidia/personaplex-7b-v1", None, ("nvidia/personaplex-7b-v1", "model.safetensors")),
        ("nvidia/personaplex-7b-v1", 16, ("nvidia/personaplex-7b-v1", "model.safetensors")),
    ],
)
def test_repo_and_lm_file(repo, bits, expected):
    assert hub.repo_and_lm_file(repo, bits) == expected


def test_bad_quantize_is_a_config_error():
    with pytest.raises(ConfigError, match="must be 4, 8 or 16"):
        hub.repo_and_lm_file(None, 5)


def test_personaplex_publishes_bf16_only():
    with pytest.raises(ConfigError, match="publishes only bf16 weights: make a q4 file"):
        hub.repo_and_lm_file("nvidia/personaplex-7b-v1", 4)


def test_voices_are_found_beside_the_weights_then_in_the_weights_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.WEIGHTS_ENV, str(tmp_path / "weights"))
    beside = _touch(tmp_path / "model", ("model.safetensors", hub.VOICES_FILE))
    files = hub.WeightFiles(beside / "model.safetensors", beside, beside)
    assert hub.resolve_voices(files) == beside / hub.VOICES_FILE
    (beside / hub.VOICES_FILE).unlink()
    folder = _touch(tmp_path / "weights", (hub.VOICES_FILE,))
    assert hub.resolve_voices(files) == folder / hub.VOICES_FILE


def _touch(folder, names):
    """Stand-in files: a safetensors file with no tensor (a given weight file is opened
    before any download), one byte for the others."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        empty = struct.pack("<Q", 8) + b"{}      "
        (folder / name).write_bytes(empty if name.endswith(".safetensors") else b"x")
    return folder


def test_weights_folder_is_searched_and_flags_win(tmp_path, monkeypatch):
    folder = _touch(tmp_path / "w", ("model.q8.safetensors", "config.json", *NAMES))
    (folder / "config.json").write_text("{}")  # read while resolving: its model_type
    monkeypatch.setenv(hub.WEIGHTS_ENV, str(folder))
    files = hub.resolve_weights(quantize=8)
    assert files == hub.WeightFiles(
        moshi=folder / "model.q8.safetensors",
        mimi=folder / hub.MIMI_FILE,
        tokenizer=folder / hub.TOKENIZER_FILE,
        config=ConfigSource(folder / "config.json"),
    )
    mine = _touch(tmp_path / "mine", ("lm.safetensors",)) / "lm.safetensors"
    files = hub.resolve_weights(moshi_weight=mine)
    assert files.moshi == mine and files.mimi == folder / hub.MIMI_FILE
    assert files.config.path == folder / "config.json"  # none beside lm.safetensors


def test_a_given_file_that_is_not_safetensors_is_refused_with_its_parameter(tmp_path):
    wav = tmp_path / "speech.wav"
    wav.write_bytes(b"RIFF" + bytes(60))
    with pytest.raises(WeightsError, match=f"^{wav} is not a safetensors file") as refused:
        hub.resolve_weights(moshi_weight=wav)
    assert refused.value.parameter == "moshi_weight"


def test_missing_flag_path_names_the_flag(tmp_path):
    with pytest.raises(WeightsError, match="mimi_weight=.*nope.safetensors: file not found"):
        hub.resolve_weights(mimi_weight=tmp_path / "nope.safetensors")


def _resolve_in_subprocess(tmp_path, hf_home, *args):
    """huggingface_hub reads HF_HOME / HF_HUB_OFFLINE at import: use a fresh interpreter."""
    env = {
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        hub.WEIGHTS_ENV: str(tmp_path / "empty"),
        "PATH": "/usr/bin:/bin",
    }
    code = (
        "import sys; from moshi_mlx.cli.common import run_cli; from moshi_mlx.checkpoints.hub import resolve_weights"
        "\ndef go(argv):"
        "\n    print(resolve_weights(*[int(a) if a.isdigit() else a for a in argv]))"
        "\n    return 0"
        "\nsys.exit(run_cli(go, sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_files_come_from_the_hugging_face_cache(tmp_path):
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hf" / "hub" / "models--kyutai--moshika-mlx-q8"
    _touch(repo_dir / "snapshots" / revision, ("model.q8.safetensors", *NAMES))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    done = _resolve_in_subprocess(tmp_path, tmp_path / "hf", "kyutai/moshika-mlx-q4", "8")
    assert done.returncode == 0, done.stderr
    snapshot = repo_dir / "snapshots" / revision
    assert f"moshi=PosixPath('{snapshot}/model.q8.safetensors')" in done.stdout
    assert f"tokenizer=PosixPath('{snapshot}/{hub.TOKENIZER_FILE}')" in done.stdout
    assert "config=ConfigSource(path=None, given=None)" in done.stdout  # the 7B preset


def test_offline_without_files_says_what_to_download_and_where(tmp_path):
    done = _resolve_in_subprocess(tmp_path, tmp_path / "empty_hf")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("error: cannot get model.q4.safetensors")
    assert "https://huggingface.co/kyutai/moshiko-mlx-q4" in lines[0]
    assert f"put it in {tmp_path / 'empty'}/" in lines[0] and "--moshi-weight" in lines[0]


def test_a_local_folder_is_a_repo(tmp_path, monkeypatch):
    monkeypatch.setenv(hub.WEIGHTS_ENV, str(_touch(tmp_path / "weights", NAMES)))
    folder = _touch(tmp_path / "snapshot", ("model.q8.safetensors", *NAMES))
    (folder / "config.json").write_text("{}")
    files = hub.resolve_weights(str(folder))
    assert files == hub.WeightFiles(
        moshi=folder / "model.q8.safetensors",  # the most precise LM file it holds
        mimi=folder / hub.MIMI_FILE,  # the folder's, not the weights folder's
        tokenizer=folder / hub.TOKENIZER_FILE,
        config=ConfigSource(folder / "config.json"),
    )
    assert files.repo == str(folder) and files.config.data == {}
    (folder / hub.VOICES_FILE).write_bytes(b"x")
    assert hub.resolve_voices(files) == folder / hub.VOICES_FILE


def test_a_folder_missing_a_file_names_it_in_one_line(tmp_path):
    folder = _touch(tmp_path / "snapshot", ("model.q4.safetensors", hub.MIMI_FILE))
    with pytest.raises(WeightsError) as caught:
        hub.resolve_weights(str(folder))
    message = str(caught.value)
    assert message == f"{folder} has no {hub.TOKENIZER_FILE} (or pass tokenizer=PATH)"
    stt = _touch(tmp_path / "stt", ())
    (stt / "config.json").write_text('{"model_type": "stt", "mimi_name": "mimi.safetensors"}')
    with pytest.raises(WeightsError, match=f"{stt} has no model.safetensors"):
        hub.resolve_weights(str(stt), config_required=True)


@pytest.mark.parametrize("repo", ["/no/such/folder", "./not_here", "~/not_here_either", "a/b/c"])
def test_a_path_that_is_no_folder_is_refused_without_a_hub_url(repo):
    with pytest.raises(WeightsError) as caught:
        hub.resolve_weights(repo)
    message = str(caught.value)
    assert f"the repo {repo} does not exist" in message
    assert "huggingface.co" not in message and "\n" not in message


def test_a_file_given_as_the_repo_is_refused(tmp_path):
    file = _touch(tmp_path, ("model.safetensors",)) / "model.safetensors"
    with pytest.raises(WeightsError, match=f"the repo {file} is a file"):
        hub.resolve_weights(str(file))
