"""Kyutai's own `python -m moshi.client` (from /opt/venvs/ref), unchanged, against
`python -m moshi_mlx web`, with its sound devices on a private PulseAudio server:
espeak-ng speech into the virtual microphone, Moshi's reply recorded from the speaker."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from pulse import PulseServer, pulseaudio_missing_reason
from tiny_moshi import (
    cached_tiny_moshi,
    espeak_speech,
    tiny_moshi_command,
)
from web_harness import free_port

from moshi_mlx.audio.wav import read_audio

REF_PYTHON = Path("/opt/venvs/ref/bin/python")
pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        not REF_PYTHON.exists(),
        reason="Kyutai's moshi reference env missing: run scripts/make_reference_envs.sh",
    ),
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
TALK_SECONDS = 6.0


def _wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert process.poll() is None and time.monotonic() < deadline, path.read_text()
        time.sleep(0.1)


def test_kyutai_python_client_talks_with_our_server(tmp_path, tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    speech_file = espeak_speech(tmp_path / "user.wav", "Hello Moshi, can you hear me?")
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    port = free_port()
    server_log, client_out, client_err = (tmp_path / n for n in ("server", "out", "err"))
    with PulseServer(tmp_path / "pulse") as pulse, open(server_log, "wb") as log:
        server = subprocess.Popen(
            tiny_moshi_command("moshi_mlx web", files, "--port", str(port), "--no-browser"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(server_log, "ready: ", server, 120)
            pulse.start_recording(tmp_path / "speaker.raw")
            with open(client_out, "wb") as out, open(client_err, "wb") as err:
                client = subprocess.Popen(
                    [
                        str(REF_PYTHON),
                        "-m",
                        "moshi.client",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ],
                    env=pulse.env(),
                    stdout=out,
                    stderr=err,
                )
                try:
                    _wait_for(client_err, "connected!", client, 60)
                    pulse.feed_mic(read_audio(speech_file))
                    time.sleep(TALK_SECONDS)
                    assert client.poll() is None, client_err.read_text()
                    # (At Ctrl-C the client reports a lost connection itself: judge before.)
                    err = client_err.read_text(errors="replace")
                finally:
                    client.send_signal(signal.SIGINT)
                    try:
                        client.wait(10)
                    except subprocess.TimeoutExpired:
                        client.kill()
            pulse.stop_recording()
        finally:
            server.terminate()
            server.wait(10)
    text = client_out.read_text(errors="replace")
    print(f"\nmoshi.client printed {text!r}")
    assert "Lost connection" not in err and "Traceback" not in err, err
    assert text.strip(), err  # Moshi's text pieces, printed by Kyutai's client
    speaker = np.fromfile(tmp_path / "speaker.raw", "<i2").astype(np.float32) / 32768
    blocks = speaker[: len(speaker) // 1920 * 1920].reshape(-1, 1920)
    assert int((np.abs(blocks).max(axis=1) > 1e-3).sum()) >= 3  # Moshi's audio was played
    assert "conversation started" in server_log.read_text()
