"""How `python -m moshi_mlx serve` ends, on tiny models: after a request of each route family,
SIGTERM and Ctrl-C exit with 130 and a start-up error with 2, one line, never an abort
(`terminate called without an active exception`, 134: the model thread's MLX state freed
while the interpreter finalized)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
from tiny_moshi import TINY_TTS, cached_tiny_moshi, cached_tiny_stt, fast_codec, weight_flags
from web_harness import Reply as ChatReply
from web_harness import free_port, has_handshake, ogg_pages, read_until

from moshi_mlx.serve.chat import protocol as chat_protocol
from moshi_mlx.testing.llm import write_tiny_llm
from moshi_mlx.tts.voices import DEFAULT_VOICE, voice_file_name

ROOT = Path(__file__).parents[2]
ABORT = "terminate called"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, list[str]]:
    """The serve flags of each tiny model: folders laid out as Kyutai's repos (config.json
    naming its files), Moshi by its files."""
    root = tmp_path_factory.mktemp("serve_exit")
    moshi = cached_tiny_moshi(tmp_path_factory)
    stt_files = cached_tiny_stt(tmp_path_factory)
    stt = _folder(root / "stt", stt_files, json.loads(stt_files["lm_config"].read_text()))
    tts_config = json.loads((TINY_TTS / "config.json").read_text())
    tts_files = {
        "moshi": TINY_TTS / tts_config["moshi_name"],
        "tokenizer": TINY_TTS / tts_config["tokenizer_name"],
        "mimi": moshi["mimi"],
    }
    tts = _folder(root / "tts", tts_files, tts_config)
    voices = root / "voices"
    from moshi_mlx.models.config import LmConfig

    path = voices / voice_file_name(DEFAULT_VOICE, LmConfig.from_dict(tts_config))
    path.parent.mkdir(parents=True)
    shutil.copyfile(TINY_TTS / "voices" / "alice.safetensors", path)  # no link out: refused
    return {
        "chat": ["--moshi", *weight_flags(moshi), "--codec", fast_codec()],
        "stt": ["--stt", str(stt)],
        "tts": ["--tts", str(tts), "--voice-repo", str(voices)],
        "llm": ["--llm", str(write_tiny_llm(root / "llm"))],
    }


def _folder(folder: Path, files: dict[str, Path], config: dict) -> Path:
    folder.mkdir()
    for key, name in (
        ("moshi", "moshi_name"),
        ("mimi", "mimi_name"),
        ("tokenizer", "tokenizer_name"),
    ):
        (folder / files[key].name).symlink_to(files[key])
        config[name] = files[key].name
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _start(flags: list[str], port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "moshi_mlx", "serve", "--port", str(port), *flags]
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_ready(process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while "ready: " not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


async def _chat(base: str) -> None:
    url = f"ws://{base}/api/chat"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        reply = await read_until(ws, ChatReply(), has_handshake)
        for page in ogg_pages(np.zeros(1920 * 12, np.float32)):
            await ws.send_bytes(chat_protocol.audio(page))
            await asyncio.sleep(0.08)
        await read_until(ws, reply, lambda r: len(r.audio) >= 1)


async def _stt(base: str) -> None:
    url = f"ws://{base}/api/asr-streaming"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        audio = {"type": "Audio", "pcm": [0.0] * 1920 * 8}
        await ws.send_bytes(msgpack.packb(audio, use_single_float=True))
        while msgpack.unpackb((await ws.receive(timeout=60)).data)["type"] != "Step":
            pass


def _hit(family: str, port: int, flags: list[str]) -> None:
    base = f"127.0.0.1:{port}"
    if family == "chat":
        asyncio.run(asyncio.wait_for(_chat(base), 120))
    elif family == "stt":
        asyncio.run(asyncio.wait_for(_stt(base), 120))
    elif family == "tts":
        speech = {"model": "tts", "input": "Hello there.", "voice": "alloy"}
        assert _post(f"http://{base}/v1/audio/speech", {**speech, "response_format": "mp3"})
    else:
        chat = {"model": flags[1], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert json.loads(_post(f"http://{base}/v1/chat/completions", chat))["choices"]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("family", ["chat", "stt", "tts", "llm"])
def test_a_stop_after_a_request_exits_130(models, tmp_path, family, stop):
    port, log = free_port(), tmp_path / "serve.log"
    process = _start(models[family], port, log)
    try:
        _wait_ready(process, log)
        _hit(family, port, models[family])
        process.send_signal(stop)
        code = process.wait(60)
    finally:
        process.kill()
        process.wait()
    output = log.read_text()
    assert code == 130 and ABORT not in output and "Traceback" not in output, (code, output)
    assert output.rstrip().endswith("interrupted"), output


def test_a_port_in_use_after_loading_exits_2_in_one_line(models, tmp_path):
    log = tmp_path / "serve.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = _start(models["tts"], taken.getsockname()[1], log)
        code = process.wait(180)
    output = log.read_text()
    assert code == 2 and ABORT not in output and "Traceback" not in output, (code, output)
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: cannot listen on 127.0.0.1"), output


def test_a_bad_port_exits_2_before_anything_loads(models, tmp_path):
    log = tmp_path / "serve.log"
    process = _start([*models["tts"]], -1, log)
    assert process.wait(60) == 2
    assert log.read_text().strip().splitlines() == [
        "error: argument --port: must be from 1 to 65535, got -1"
    ]
