"""Our page in headless Chromium against `python -m moshi_mlx web` on a tiny random
checkpoint, driven through the DevTools protocol. The fake microphone plays espeak-ng speech.

Needs Debian's `chromium` (`apt install chromium`; scripts/run_tests.sh installs it as root).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from urllib.parse import parse_qs, urlsplit

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from chromium import Chromium, chromium_binary, poll_stats
from tiny_moshi import (
    cached_tiny_moshi,
    cached_tiny_personaplex,
    espeak_speech,
    load_tiny_model,
    tiny_moshi_command,
)
from web_harness import ServerThread, free_port

from moshi_mlx.chat.persona.cache import CACHE_ENV
from moshi_mlx.chat.persona.role import DEFAULT_ROLE, EXAMPLE_ROLES

pytestmark = pytest.mark.skipif(
    chromium_binary() is None,
    reason="chromium not installed (Debian: apt install chromium; scripts/run_tests.sh does it)",
)
PERSONA_HIDDEN = "document.getElementById('persona').hidden"
CLICK_START = "document.getElementById('start').click()"


def _mic_wav(tmp_path):
    """48 kHz speech for Chromium's fake microphone (a 24 kHz file would arrive as silence)."""
    path = espeak_speech(tmp_path / "mic48k.wav", "hello moshi, how are you today?", rate=48000)
    if path is None:  # no espeak-ng/sox: a modulated tone, still 48 kHz
        t = np.arange(3 * 48000) / 48000
        tone = 0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 2 * t)
        path = tmp_path / "mic48k.wav"
        sf.write(path, tone.astype(np.float32), 48000, subtype="PCM_16")
    return path


@pytest.fixture
def local_web(tmp_path_factory, tmp_path):
    """`python -m moshi_mlx web` on a free port; yields (url, process, log path).

    Its "open the page" goes to a $BROWSER command that writes the URL to a file.
    """
    files = cached_tiny_moshi(tmp_path_factory)
    port = free_port()
    log, opened = tmp_path / "server.log", tmp_path / "opened.txt"
    record_url = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])"
    env = {**os.environ, "BROWSER": f'{sys.executable} -c "{record_url}" {opened} %s'}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            tiny_moshi_command("moshi_mlx web", files, "--port", str(port)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + 120
    while "ready: " not in log.read_text() or not opened.exists():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    assert opened.read_text() == f"http://localhost:{port}"  # after load and warm-up
    yield f"http://localhost:{port}/", process, log
    if process.poll() is None:
        process.terminate()
        process.wait(10)


async def _poll(page, done, timeout: float) -> dict | None:
    return await poll_stats(page, "moshiStats", done, timeout)


def _talking(stats: dict) -> bool:
    return (
        stats["state"] == "live"
        and stats["sentSeconds"] > 1.0
        and stats["micSoundSamples"] > 0
        and stats["receivedAudioMessages"] >= 5
        and stats["playedSoundSamples"] > 0
        and len(stats["text"].strip()) > 0
    )


def test_page_talks_with_moshi_in_chromium(local_web, tmp_path):
    url, server, log = local_web

    async def scenario():
        with Chromium(tmp_path, fake_mic_wav=_mic_wav(tmp_path)) as browser:
            async with aiohttp.ClientSession() as session:
                page = await browser.open(session, url)
                await _poll(page, lambda s: True, 10)  # the module has loaded
                no_persona = await page.evaluate(PERSONA_HIDDEN)  # Moshi: nothing to choose
                await page.evaluate(CLICK_START, user_gesture=True)
                talking = await _poll(page, _talking, 60)
                await page.screenshot(tmp_path / "talking.png")
                shown = await page.evaluate(
                    "[...document.querySelectorAll('#state, #latency, #keeps-up, #text')]"
                    ".map(e => e.textContent)"
                )
                second = await browser.open(session, url)  # one conversation at a time
                await _poll(second, lambda s: True, 10)
                await second.evaluate(CLICK_START, user_gesture=True)
                busy = await _poll(second, lambda s: s["error"], 20)
                await second.screenshot(tmp_path / "busy.png")
                server.terminate()  # the page must say that the connection closed
                closed = await _poll(page, lambda s: s["error"], 20)
                await page.screenshot(tmp_path / "closed.png")
                return talking, shown, busy, closed, page.console, no_persona

    talking, shown, busy, closed, console, no_persona = asyncio.run(
        asyncio.wait_for(scenario(), 180)
    )
    assert no_persona and talking["voices"] is None
    assert talking["chatUrl"] == f"{url.replace('http', 'ws')}api/chat"
    assert _talking(talking), (talking, console[-20:], log.read_text()[-2000:])
    assert talking["sentSeconds"] > 1.0 and talking["receivedSeconds"] > 0.3  # both ways
    assert talking["latencyMs"] is not None and talking["latencyMs"] > 0
    state, latency, keeps_up, text = shown
    assert state.startswith("connected") and latency.endswith(" ms") and text.strip()
    assert keeps_up in ("keeps up",) or keeps_up.startswith("falling behind")
    assert "busy" in busy["error"] and busy["state"] == "closed", busy
    assert "connection to Moshi was closed" in closed["error"], closed
    assert (tmp_path / "talking.png").stat().st_size > 10_000


def test_page_explains_a_denied_microphone(tmp_path):
    """Without the auto-accepting fake UI, headless Chromium denies the microphone."""
    loaded = threading.Event()
    running = ServerThread(lambda: loaded.wait(60))  # the page alone: no model needed
    port = running.serve()

    async def scenario():
        with Chromium(tmp_path, deny_mic=True) as browser:
            async with aiohttp.ClientSession() as session:
                page = await browser.open(session, f"http://localhost:{port}/")
                await _poll(page, lambda s: True, 10)
                await page.evaluate(CLICK_START, user_gesture=True)
                stats = await _poll(page, lambda s: s["error"], 20)
                await page.screenshot(tmp_path / "denied.png")
                return stats

    try:
        stats = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        loaded.set()
        running.close()
    assert "Microphone access was denied" in stats["error"], stats


PICK_PERSONA = """(() => {
  const voice = document.getElementById('voice'), examples = document.getElementById('examples');
  const shown = {
    hidden: document.getElementById('persona').hidden,
    voices: [...voice.options].map(o => o.value),
    voice: voice.value,
    role: document.getElementById('role').value,
    examples: [...examples.options].slice(1).map(o => o.value),
  };
  voice.value = 'NATM1';
  examples.value = examples.options[3].value;
  examples.dispatchEvent(new Event('change'));
  shown.picked = document.getElementById('role').value;
  document.getElementById('role').value = ' You are\\n a tutor. ';  // the tiny model's context is short
  return JSON.stringify(shown);
})()"""


def test_page_chooses_a_persona(tmp_path, tmp_path_factory, monkeypatch):
    """PersonaPlex: the page shows the voices and roles of /api/persona and connects with
    the chosen ones."""
    files = cached_tiny_personaplex(tmp_path_factory)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "prompts"))
    running = ServerThread(lambda: load_tiny_model(files))
    port = running.serve()

    async def scenario():
        with Chromium(tmp_path, fake_mic_wav=_mic_wav(tmp_path)) as browser:
            async with aiohttp.ClientSession() as session:
                page = await browser.open(session, f"http://localhost:{port}/")
                await _poll(page, lambda s: s["voices"], 60)  # after the model's warm-up
                shown = json.loads(await page.evaluate(PICK_PERSONA))
                await page.evaluate(CLICK_START, user_gesture=True)
                live = await _poll(page, lambda s: s["state"] == "live" or s["error"], 30)
                await page.screenshot(tmp_path / "persona.png")
                return shown, live, page.console

    try:
        shown, live, console = asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        running.close()
    assert shown == {
        "hidden": False,
        "voices": ["NATF2", "NATM1"],
        "voice": "NATF2",
        "role": DEFAULT_ROLE,
        "examples": [DEFAULT_ROLE, *EXAMPLE_ROLES],
        "picked": EXAMPLE_ROLES[1],
    }
    assert live["state"] == "live" and not live["error"], (live["error"], live, console[-20:])
    query = parse_qs(urlsplit(live["chatUrl"]).query)
    assert query == {"voice_prompt": ["NATM1"], "text_prompt": ["You are a tutor."]}
