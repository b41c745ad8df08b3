"""Headless Chromium driven through the DevTools protocol, for the browser tests.

    with Chromium(tmp_path, fake_mic_wav=wav) as browser:
        page = await browser.open(url)  # inside a running event loop
        await page.evaluate("document.title")
        await page.screenshot(path)

Uses Debian's `chromium` (no Playwright download) with a fake microphone that plays a wav
(it must be 48 kHz: other rates reach the page as silence) and auto-granted permissions.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

if TYPE_CHECKING:
    from typing_extensions import Self

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    """Path of a Chromium-like browser, or None."""
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Chromium:
    """A headless browser process with remote debugging on a port it picks itself."""

    def __init__(self, root: Path, fake_mic_wav: Path | None = None, deny_mic: bool = False):
        self.root = Path(root)
        self.profile = self.root / "chromium-profile"
        self.fake_mic_wav = fake_mic_wav
        self.deny_mic = deny_mic
        self.log_path = self.root / "chromium.log"
        self._process: subprocess.Popen | None = None
        self.port: int | None = None

    def __enter__(self) -> Self:
        binary = chromium_binary()
        assert binary is not None, "chromium not installed"
        self.profile.mkdir(parents=True, exist_ok=True)
        (self.profile / "DevToolsActivePort").unlink(missing_ok=True)  # a stale one's port
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--autoplay-policy=no-user-gesture-required",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-port=0",
            "--use-fake-device-for-media-stream",
            "--window-size=1000,900",
        ]
        if not self.deny_mic:
            flags.append("--use-fake-ui-for-media-stream")
        if self.fake_mic_wav is not None:
            flags.append(f"--use-file-for-fake-audio-capture={self.fake_mic_wav}")
        self._log = open(self.log_path, "wb")
        self._process = subprocess.Popen(
            [binary, *flags, "about:blank"], stdout=self._log, stderr=subprocess.STDOUT
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.is_file() or not port_file.read_text().strip():
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {self.log_path.read_text()}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        return self

    def __exit__(self, *exc_info) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    async def open(self, session: aiohttp.ClientSession, url: str) -> Page:
        """A new tab showing `url`, with Runtime, Page and Log events enabled."""
        async with session.put(f"http://127.0.0.1:{self.port}/json/new?{url}") as response:
            target = json.loads(await response.text())
        ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        await page.call("Runtime.enable")
        await page.call("Page.enable")
        return page


class Page:
    """One tab's DevTools session: commands with `call`, console messages in `console`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.console: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            data = json.loads(message.data)
            if "id" in data and data["id"] in self._waiting:
                self._waiting.pop(data["id"]).set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"]["args"]
                self.console.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in args)
                )
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append(f"exception: {data['params']['exceptionDetails']}")

    async def call(self, method: str, **params) -> dict:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 30)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str, user_gesture: bool = False):
        """The JSON value of `expression` in the page (awaiting it if it is a promise)."""
        result = await self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
            userGesture=user_gesture,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        data = await self.call("Page.captureScreenshot", format="png")
        Path(path).write_bytes(base64.b64decode(data["data"]))
        return Path(path)

    async def close(self) -> None:
        self._reader.cancel()
        await self._ws.close()


async def poll_stats(page, stats: str, done, timeout: float) -> dict | None:
    """The page's `window.<stats>` object once `done(stats)` holds, or as it is after `timeout`
    seconds (None while the page's module has not run)."""
    script = f"window.{stats} ? JSON.stringify(window.{stats}) : null"
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        raw = await page.evaluate(script)
        found = json.loads(raw) if raw else None
        if (found and done(found)) or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.25)
