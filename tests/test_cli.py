"""One command-line dialect: `python -m moshi_mlx <command>`, the same flags everywhere, old
spellings kept as hidden aliases, library errors shown in flag terms."""

import subprocess
import sys

import pytest

from moshi_mlx.cli.common import in_flag_terms
from moshi_mlx.cli.main import COMMANDS


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
    if command == "serve":  # several models: one REPO|FOLDER flag each
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
    ("message", "shown"),
    [
        ("kv_bits must be one of (8, 4), got 3", "--kv-bits must be one of (8, 4), got 3"),
        ("it fits with quantize=4 kv_bits=4 (5 GB)", "it fits with -q 4 --kv-bits 4 (5 GB)"),
        ("mimi_weight=/a/b.safetensors: file not found", "--mimi-weight /a/b.safetensors: file"),
        ("x exists; pass force=True to overwrite it", "x exists; pass --force to overwrite it"),
        ("no device; check with format_devices()", "no device; check with --list-devices"),
        # plain words and paths are left alone: only `name=` of a one-word parameter
        ("the model's context and voice", "the model's context and voice"),
        ("/w/lm_config/kv_bits.json is bad", "/w/lm_config/kv_bits.json is bad"),
    ],
)
def test_library_errors_are_shown_in_flag_terms(message, shown):
    assert in_flag_terms(message).startswith(shown)
