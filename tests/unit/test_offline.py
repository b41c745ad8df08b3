"""Offline without HF_HUB_OFFLINE (issue 41.5): the hub is found down once, each missing file
is named at once with what to do, and nothing waits for the hub client's retries. The hub's
endpoint is a closed local port: refused at once, as a Mac with no network is."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from cli_checks import error_line, run_python

from moshi_mlx.checkpoints.spec import DEFAULT_STT_REPO

TTS_CONFIG = Path(__file__).parents[1] / "fixtures" / "tts" / "config.json"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def offline(tmp_path):
    """An environment whose hub cannot be reached (and an empty cache and weights folder)."""
    env = dict(os.environ)
    env.pop("HF_HUB_OFFLINE", None)
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}",
        HF_HOME=str(tmp_path / "hf"),
        MOSHI_MLX_WEIGHTS=str(tmp_path / "no_weights"),
    )
    return env


def _run(env, *args, cwd=None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = run_python(env, *args, cwd=cwd)
    return done, time.monotonic() - started


def test_stt_offline_fails_at_once_in_one_line_saying_what_to_do(offline, tmp_path):
    speech = tmp_path / "speech.wav"
    sf.write(speech, np.zeros(4800, np.float32), 24000)
    done, seconds = _run(offline, "-m", "moshi_mlx", "stt", speech)
    line = error_line(done)  # no retry lines of the hub client
    assert seconds < 15, seconds  # 24 s of retries before
    assert f"cannot get config.json from the Hugging Face repo {DEFAULT_STT_REPO}" in line
    assert "the hub cannot be reached" in line and "not in the local cache" in line
    assert f"`hf download {DEFAULT_STT_REPO}`" in line and "--lm-config" in line


def test_a_mistyped_folder_is_neither_a_folder_nor_reachable(offline, tmp_path):
    sf.write(tmp_path / "in.wav", np.zeros(4800, np.float32), 24000)
    done, _ = _run(offline, "-m", "moshi_mlx", "stt", "in.wav", "--hf-repo", "w/none", cwd=tmp_path)
    line = error_line(done)
    assert "there is no folder w/none here, and the hub cannot be reached" in line


def _in_process(env, code: str) -> subprocess.CompletedProcess:
    """`code` run in a fresh interpreter (the hub client reads its endpoint at import)."""
    done, _ = _run(env, "-c", f"TTS_CONFIG = {str(TTS_CONFIG)!r}\n{code}")
    assert done.returncode == 0, done.stderr
    return done


def test_the_hub_is_probed_once_and_voices_fail_at_once(offline):
    """A voice that is not local: one line at once (46 s before, then a 503), and the probe
    is not repeated for the next file."""
    code = """
import time
from moshi_mlx.checkpoints import online
from moshi_mlx.errors import TtsError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.tts.voices import DEFAULT_VOICE, default_voice_status, resolve_voice

probes = []
probe = online._probe
online._probe = lambda: probes.append(1) or probe()
config = LmConfig.from_dict(__import__("json").load(open(TTS_CONFIG)))
started = time.monotonic()
for voice in ("expresso/nope.wav", "vctk/p225_023.wav", DEFAULT_VOICE):
    try:
        resolve_voice(voice, config)
    except TtsError as exc:
        print(exc)
print(default_voice_status(config))
print(len(probes), round(time.monotonic() - started, 1))
"""
    lines = _in_process(offline, code).stdout.strip().splitlines()
    assert all("the hub cannot be reached" in line for line in lines[:3])
    assert "`hf download kyutai/tts-voices vctk/p225_023.wav." in lines[1]
    assert lines[2].startswith("no voice was given, and the default voice (expresso/")
    assert "`hf download kyutai/tts-voices expresso/" in lines[2]  # what a TTS socket gets
    assert lines[3].startswith("the default voice (expresso/") and "not downloaded" in lines[3]
    assert "`hf download kyutai/tts-voices expresso/" in lines[3]
    probes, seconds = lines[4].split()
    assert probes == "1" and float(seconds) < 10


def test_an_openai_voice_name_says_it_stands_for_the_missing_default(offline):
    code = """
import json
from moshi_mlx.models.config import LmConfig
from moshi_mlx.serve.openai.errors import ApiError
from moshi_mlx.serve.openai.voices import VoiceCatalog

config = LmConfig.from_dict(json.load(open(TTS_CONFIG)))
try:
    VoiceCatalog(config, "kyutai/tts-voices").resolve("alloy")
except ApiError as exc:
    print(exc.status, exc.message)
"""
    out = _in_process(offline, code).stdout
    assert out.startswith("503 voice 'alloy' stands for the default voice, which is not")
    assert "`hf download kyutai/tts-voices expresso/" in out


def test_serve_says_where_the_default_voice_is(tmp_path, monkeypatch):
    """The start-up line of `serve --tts`: local, or downloaded on first use (hub up)."""
    import json

    from moshi_mlx.checkpoints import hub, online
    from moshi_mlx.models.config import LmConfig
    from moshi_mlx.tts.voices import DEFAULT_VOICE, default_voice_status, voice_file_name

    monkeypatch.setenv(hub.WEIGHTS_ENV, str(tmp_path / "no_weights"))
    config = LmConfig.from_dict(json.loads(TTS_CONFIG.read_text()))
    voice = tmp_path / "voices" / voice_file_name(DEFAULT_VOICE, config)
    voice.parent.mkdir(parents=True)
    voice.write_bytes(b"")
    status = default_voice_status(config, str(tmp_path / "voices"))
    assert status == f"the default voice ({DEFAULT_VOICE}) is local: {voice}"
    monkeypatch.setattr(online, "_HUB", online._HubState())
    monkeypatch.setattr(online, "_probe", lambda: None)  # the hub answers
    assert default_voice_status(config, "someone/voices").endswith(
        "will be downloaded from someone/voices on first use"
    )


class _NoRepoHub(http.server.BaseHTTPRequestHandler):
    """A hub that answers every request as the Hugging Face hub does for a repo that does not
    exist (401 and its error code)."""

    def _answer(self):
        self.send_response(401)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args):
        pass


def test_a_mistyped_folder_that_the_hub_does_not_have_either_is_named_as_both(offline, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoRepoHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        online = {**offline, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        sf.write(tmp_path / "in.wav", np.zeros(4800, np.float32), 24000)
        done, seconds = _run(
            online, "-m", "moshi_mlx", "stt", "in.wav", "--hf-repo", "w/none", cwd=tmp_path
        )
    finally:
        server.shutdown()
    line = error_line(done)
    assert "there is no folder w/none here, and there is no Hugging Face repo w/none" in line
    assert seconds < 15, seconds
