"""`python -m moshi_mlx assistant` with a TTS of cloned voices only (the tiny layout of
kyutai/tts-0.75b-en-public, tests/fixtures/tts_075) through a private PulseAudio server, as
tests/e2e/test_assistant_e2e.py runs it: `--voice speech.wav` clones the recording's voice
and the greeting is spoken in it; without a recording the command stops before the LLM
loads with one line naming `--voice`."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from assistant_cli import DEVICES, ROOT, cli_env, running_assistant, wait_for, write_model_flags
from pulse import pulseaudio_missing_reason

pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
TTS_075_FIXTURES = ROOT / "tests" / "fixtures" / "tts_075"


@pytest.fixture(scope="module")
def model_flags(tmp_path_factory) -> list[str]:
    """The tiny STT and LLM with the tiny tts-0.75b layout, no `--voice`."""
    flags = write_model_flags(tmp_path_factory.mktemp("models"), tts_fixtures=TTS_075_FIXTURES)
    return flags[: flags.index("--voice")]


def test_a_recording_given_as_the_voice_is_cloned_and_speaks(pulse, model_flags, tmp_path):
    recording = tmp_path / "speech.wav"  # one second of noise: the tiny Mimi takes anything
    noise = np.random.default_rng(0).standard_normal(24_000).astype(np.float32)
    sf.write(recording, 0.1 * noise, 24_000)
    transcript, stderr_path, speaker = tmp_path / "t.txt", tmp_path / "err.txt", tmp_path / "s"
    flags = [*model_flags, "--voice", str(recording), "--max-tokens", "8"]
    flags += ["--transcript", str(transcript)]
    pulse.start_recording(speaker)
    pulse.feed_mic(np.zeros(0, np.float32))
    with running_assistant(flags, pulse, tmp_path, stderr_path) as proc:
        wait_for(transcript, "\n", proc, wait_for(transcript, "assistant: ", proc))  # played
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    pulse.stop_recording()
    err = stderr_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in err, err
    pcm = np.fromfile(speaker, "<i2").astype(np.float32) / 32768
    assert np.abs(pcm).max() > 1e-3  # the greeting reached the speaker


def test_without_a_recording_it_says_which_flag_to_give(pulse, model_flags, tmp_path):
    command = [sys.executable, "-m", "moshi_mlx", "assistant", *model_flags, *DEVICES]
    env = cli_env(pulse, tmp_path)
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1] == (
        "error: this model clones the voice of a recording: give --voice speech.wav (a few "
        "seconds of speech; it has no named voices)"
    )
    assert "Traceback" not in done.stderr and "loading LLM" not in done.stderr
