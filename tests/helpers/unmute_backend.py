"""Kyutai's Unmute backend (`uvicorn unmute.main_websocket:app`) in its own venv, started as a
subprocess pointed at our services: scripts/make_unmute_env.sh builds that venv."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

VENV = Path(os.environ.get("MOSHI_MLX_REFERENCE_ENVS", "/opt/venvs")) / "unmute"
PYTHON = VENV / "bin" / "python"
SOURCE = VENV / "src"  # the copy of Unmute's tree the venv runs (voices.yaml beside it)


def unmute_missing_reason() -> str | None:
    """Why Unmute cannot run here, in one line; None if it can."""
    if not PYTHON.exists() or not (SOURCE / "unmute" / "main_websocket.py").exists():
        return (
            f"no Unmute venv at {VENV}: UNMUTE_SRC=/path/to/unmute "
            "./scripts/make_reference_envs.sh unmute"
        )
    return None


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str, timeout: float = 2.0) -> dict | list | None:
    """GET `url`'s JSON body; None if it does not answer 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


def wait_until(ready, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll `ready()` every 0.25 s until it is true; AssertionError after `timeout` seconds
    or if `process` exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{process.args[:4]} exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready after {timeout} s")
        time.sleep(0.25)


@contextlib.contextmanager
def unmute_backend(
    stt_url: str, tts_url: str, llm_url: str, log_path: Path, llm_model: str | None = None
) -> Iterator[str]:
    """Unmute's backend on a free loopback port, its services at these URLs (`ws://host:port`,
    `http://host:port`, no path), its output in `log_path`; yields its `http://` base URL once
    its `/v1/health` says ok."""
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("KYUTAI_", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(KYUTAI_STT_URL=stt_url, KYUTAI_TTS_URL=tts_url, KYUTAI_LLM_URL=llm_url)
    if llm_model is not None:
        env["KYUTAI_LLM_MODEL"] = llm_model
    command = [str(PYTHON), "-m", "uvicorn", "unmute.main_websocket:app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--ws-max-size", "4194304"]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=SOURCE, env=env, stdout=log, stderr=log)
        try:
            wait_until(lambda: (get_json(f"{base}/v1/health") or {}).get("ok"), 60, process)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
