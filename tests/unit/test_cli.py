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


RENAMED = [
    (["-m", "moshi_mlx.local_web", "--port", "8998"], "python -m moshi_mlx web"),
    (["-m", "moshi_mlx.run_inference", "in.wav", "out.wav"], "python -m moshi_mlx infer"),
    (["-m", "moshi_mlx.quantize", "model.safetensors"], "python -m moshi_mlx quantize"),
    (["-m", "moshi_mlx.stt", "talk.wav"], "python -m moshi_mlx stt"),
    (["-m", "moshi_mlx.tts", "Hello."], "python -m moshi_mlx tts"),
    (["-m", "moshi_mlx.serve", "--stt"], "python -m moshi_mlx serve"),
    (["-m", "moshi_mlx.assistant"], "python -m moshi_mlx assistant"),
    (["-c", "from moshi_mlx.cli.renamed import web; web()"], "moshi-mlx web"),
    (["-c", "from moshi_mlx.cli.renamed import stt; stt()"], "moshi-mlx stt"),
]


@pytest.mark.parametrize(("args", "replacement"), RENAMED)
def test_a_removed_name_says_what_replaced_it(args, replacement):
    """The old module shims and per-command scripts (pyproject's moshi-mlx-web, ... run
    `moshi_mlx.cli.renamed`): one line naming the new command, exit code 2."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: `"), done.stderr
    assert done.stderr.rstrip().endswith(f"is now `{replacement}`"), done.stderr


def test_the_documented_local_module_still_runs():
    done = subprocess.run(
        [sys.executable, "-m", "moshi_mlx.local", "--help"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m moshi_mlx.local")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_a_version_and_names_itself_as_typed(command):
    done = _run(command, "--version")
    assert done.returncode == 0 and done.stdout.startswith("moshi_mlx "), done
    assert _run(command, "--help").stdout.startswith(f"usage: python -m moshi_mlx {command} ")
    script = (
        "import sys; sys.argv[0] = '/usr/local/bin/moshi-mlx'; "
        f"from moshi_mlx.cli.main import main; main([{command!r}, '--help'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True
    )
    assert done.stdout.startswith(f"usage: moshi-mlx {command} "), done.stdout[:200]


def test_the_readme_and_serve_help_give_the_same_unmute_commands():
    from pathlib import Path

    from moshi_mlx.cli.serve import UNMUTE_COMMANDS

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    help_text = _run("serve", "--help").stdout
    for line in UNMUTE_COMMANDS.splitlines():
        assert line in readme and line in help_text, line


def test_presets_share_serves_flags_and_say_what_they_change():
    serve, web, stt = (_run(*c, "--help").stdout for c in (["serve"], ["web"], ["stt", "--serve"]))
    flags = {line.split()[0] for line in serve.splitlines() if line.startswith("  --")}
    for preset in (web, stt):
        assert flags == {line.split()[0] for line in preset.splitlines() if line.startswith("  --")}
    assert "port 8998" in web and "(default 8998)" in web and "(default 5.0)" in web
    assert "port 8080" in stt and "(default 8080)" in stt and "(default 30.0)" in stt
    assert "(default 8090)" in serve and "--max-tokens" in serve


def test_the_assistant_speaks_the_dialect():
    shown = _run("assistant", "--help").stdout
    assert "--temp " in shown and "--top-p" in shown and "--voice-repo" in shown
    assert "--temperature" not in shown  # a hidden alias of --temp
