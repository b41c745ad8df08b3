"""One command-line dialect: `python -m moshi_mlx <command>`, the same flags everywhere, old
spellings kept as hidden aliases, library errors shown in flag terms."""

import subprocess
import sys

import pytest

from moshi_mlx.cli.common import as_flag
from moshi_mlx.cli.main import COMMANDS
from moshi_mlx.errors import ConfigError, Setting


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moshi_mlx", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_shows_its_help(command):
    done = _run(command, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: ")
    if command in ("serve", "assistant"):  # several models: one REPO|FOLDER flag each
        assert all(flag in done.stdout for flag in ("--stt", "--tts", "--llm"))
    elif command != "quantize":
        assert "--hf-repo" in done.stdout and "--lm-config" in done.stdout
    for old in ("--bits", "--config", "--output-dir", "--out-folder", "--out "):
        assert old not in done.stdout  # hidden aliases


def test_each_model_states_its_sampling_defaults():
    chat, stt, tts = (_run(c, "--help").stdout for c in ("infer", "stt", "tts"))
    assert "Kyutai's Moshi defaults" in chat and "(default 0.8)" in chat and "(default 0.7)" in chat
    assert "decodes greedily" in stt and "--temp " not in stt and "--seed" not in stt
    assert "Kyutai's TTS" in tts and "text and audio temperature" in tts
    assert "(default 0.6)" in tts and "--text-temp" not in tts


def test_an_unknown_command_is_one_line():
    done = _run("transcribe")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: no command")


def test_old_spellings_still_parse():
    from moshi_mlx.cli import infer, stt, tts
    from moshi_mlx.cli.quantize import _parser

    args = _parser().parse_args(["m.safetensors", "--bits", "8", "--config", "c.json"])
    assert args.quantize == 8 and str(args.lm_config) == "c.json"
    assert _parser().parse_args(["m.safetensors"]).quantize == 4
    assert infer.parse_args(["in.wav", "out.wav"]).output == "out.wav"
    assert infer.parse_args(["in.wav", "-o", "out.wav"]).output == "out.wav"
    assert stt.parse_args(["a.wav", "--output-dir", "d"]).output == "d"
    assert tts.parse_args(["--jsonl", "r.jsonl", "--out-folder", "d"]).output == "d"
    assert tts.parse_args(["Hi.", "--out", "x.wav"]).output == "x.wav"


@pytest.mark.parametrize(
    ("parts", "api", "shown"),
    [
        ((Setting("kv_bits"), " must be 8 or 4"), "kv_bits must be 8 or 4", "--kv-bits must be"),
        (
            ("it fits with ", Setting("quantize", 4), " ", Setting("kv_bits", 4)),
            "it fits with quantize=4 kv_bits=4",
            "it fits with -q 4 --kv-bits 4",
        ),
        (
            (Setting("mimi_weight", "/a/b"), ": gone"),
            "mimi_weight=/a/b: gone",
            "--mimi-weight /a/b",
        ),
        (("pass ", Setting("force", True)), "pass force=True", "pass --force"),
        (("see ", Setting("format_devices()")), "see format_devices()", "see --list-devices"),
        # a parameter no flag sets keeps its API spelling; plain words are never touched
        ((Setting("n_q", 8), " and the context"), "n_q=8 and the context", "n_q=8 and the context"),
    ],
)
def test_library_errors_name_parameters_that_commands_show_as_flags(parts, api, shown):
    """Errors carry the parameters they name; a command spells each as its flag (no
    rewriting of the message's text)."""
    error = ConfigError(*parts, parameter="kv_bits")
    assert str(error) == api and error.parameter == "kv_bits"
    assert error.spelled(as_flag).startswith(shown)
