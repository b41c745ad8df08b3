"""Helpers of the assistant's end-to-end tests (tests/e2e/test_assistant_e2e.py,
tests/e2e/test_assistant_echo.py): the tiny models as CLI flags, the environment, the running
command, and waiting on the transcript."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pulse import PulseServer, wait_for_text
from tiny_moshi import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TTS_FIXTURES = ROOT / "tests" / "fixtures" / "tts"
WORD = "weather"  # one piece of the tiny tokenizer: what the built STT hears
DEVICES = ["--input-device", "pulse", "--output-device", "pulse"]
WAIT = 60.0  # seconds any one milestone may take on a loaded machine


def write_model_flags(
    root: Path, voice_gain: float = 1.0, tts_fixtures: Path = TTS_FIXTURES
) -> list[str]:
    """Writes the tiny STT, TTS (of `tts_fixtures`) and LLM under `root`; the CLI's flags for
    them. The STT and the TTS share a tiny Mimi whose decoder is `voice_gain` times louder
    (`write_short_memory_mimi`'s `decoder_gain`)."""
    from moshi_mlx.testing.llm import write_tiny_llm
    from moshi_mlx.testing.turn_stt import write_short_memory_mimi, write_turn_taking_stt

    mimi = write_short_memory_mimi(root / "tiny_mimi.safetensors", decoder_gain=voice_gain)
    tokenizer = write_tokenizer(root / "tokenizer.model")
    stt = write_turn_taking_stt(root / "stt", mimi, tokenizer, WORD)
    tts = link_tts_folder(root / "tts", tts_fixtures, mimi)
    llm = write_tiny_llm(root / "llm")
    voice = TTS_FIXTURES / "voices" / "alice.safetensors"
    return ["--stt", str(stt), "--tts", str(tts), "--llm", str(llm), "--voice", str(voice)]


def link_tts_folder(folder: Path, fixtures: Path, mimi: Path) -> Path:
    """`folder`, made and laid out like a TTS's hub repo: the config of `fixtures` naming its
    weights and tokenizer and the Mimi `mimi` (each linked); `folder`."""
    folder.mkdir()
    config = json.loads((fixtures / "config.json").read_text())
    config["mimi_name"] = mimi.name
    (folder / "config.json").write_text(json.dumps(config))
    for source in (fixtures / config["moshi_name"], fixtures / config["tokenizer_name"], mimi):
        (folder / source.name).symlink_to(source)
    return folder


def cli_env(pulse: PulseServer, root: Path) -> dict[str, str]:
    """The environment of `python -m moshi_mlx assistant` under `pulse`, offline."""
    env = pulse.env()
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf"))
    env["MOSHI_MLX_WEIGHTS"] = str(root / "no_weights")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def running_assistant(
    flags: list[str], pulse: PulseServer, root: Path, stderr_path: Path
) -> Iterator[subprocess.Popen]:
    """`python -m moshi_mlx assistant FLAGS` on `pulse`'s devices (stdout a text pipe, stderr
    to `stderr_path`), yielded once it listens; killed if it still runs at the end."""
    command = [sys.executable, "-m", "moshi_mlx", "assistant", *flags, *DEVICES]
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=cli_env(pulse, root),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            wait_for_text(stderr_path, "Ctrl-C to stop", proc, timeout=WAIT)
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def wait_for(path: Path, text: str, proc: subprocess.Popen, after: int = 0) -> int:
    """Wait until `text` is in the file `path` past character `after`; where it starts."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if (at := content.find(text, after)) >= 0:
            return at
        assert proc.poll() is None, content
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} after character {after} of {path}: {content!r}")
