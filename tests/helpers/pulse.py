"""A private PulseAudio server for audio tests: a null sink as the speaker and a pipe source
as the microphone, in a temporary runtime dir so it never touches a user's sound setup.

    with PulseServer(tmp_path) as pulse:
        env = pulse.env()  # PULSE_SERVER, XDG_RUNTIME_DIR, HOME for child processes
        pulse.feed_mic(pcm)  # real-time paced writes into the virtual mic
        heard = as_heard(pcm)  # what a client of the virtual mic reads (16-bit samples)
        pulse.start_recording(path)  # the speaker's monitor, raw s16le mono 24 kHz

With `echo_delay_ms`, the room has an acoustic loop: the microphone is the monitor of a
second null sink (the room), into which both the user's speech and, through
`module-loopback` with that delay, everything the speaker plays are mixed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

RATE = 24_000
SPEAKER = "moshi_test_speaker"
MIC = "moshi_test_mic"
ROOM = "moshi_test_room"
_SETTLED_USEC = 100_000  # the loopback's sink latency once settled: about 0-20 ms (see start)


def _to_s16(pcm: np.ndarray) -> np.ndarray:
    """Float `pcm` as the 16-bit samples `feed_mic` writes."""
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2")


def as_heard(pcm: np.ndarray) -> np.ndarray:
    """The float32 samples a client of the virtual mic reads for `pcm` (`feed_mic`): its
    16-bit samples over 32768, as PulseAudio converts them."""
    return _to_s16(pcm).astype(np.float32) / 32768


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the file `path`, written by the running `proc`, holds `text`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, path.read_text(errors="replace")
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} in {path.read_text(errors='replace')}")


def pulseaudio_missing_reason() -> str | None:
    """Why the audio tests cannot run here, or None if they can."""
    for tool in ("pulseaudio", "parec", "pactl"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian: apt install pulseaudio)"
    return None


class PulseServer:
    """Starts `pulseaudio` in the foreground; `close()` (or leaving the `with`) stops it."""

    def __init__(self, root: Path, echo_delay_ms: int | None = None):
        self.root = Path(root)
        self.echo_delay_ms = echo_delay_ms
        self.runtime = self.root / "runtime"
        self.home = self.root / "home"
        self.socket = self.runtime / "native"
        self.fifo = self.runtime / "mic.fifo"
        self._server: subprocess.Popen | None = None
        self._recorder: subprocess.Popen | None = None
        self._feeder: threading.Thread | None = None
        self._player: subprocess.Popen | None = None
        self._stop_feeding = threading.Event()

    def env(self) -> dict[str, str]:
        """Environment for clients of this server (PortAudio's ALSA 'pulse' plugin included)."""
        env = dict(os.environ)
        env.update(
            PULSE_SERVER=f"unix:{self.socket}",
            XDG_RUNTIME_DIR=str(self.runtime),
            HOME=str(self.home),
            PULSE_SINK=SPEAKER,
            PULSE_SOURCE=MIC,
        )
        return env

    def start(self) -> Self:
        self.runtime.mkdir(parents=True, mode=0o700)
        self.home.mkdir(parents=True)
        script = self.root / "server.pa"
        if self.echo_delay_ms is None:
            mic = (
                f"load-module module-pipe-source source_name={MIC} file={self.fifo} "
                f"format=s16le rate={RATE} channels=1\n"
            )
        else:
            mic = (
                f"load-module module-null-sink sink_name={ROOM} rate={RATE} channels=1\n"
                f"load-module module-remap-source source_name={MIC} master={ROOM}.monitor\n"
                f"load-module module-loopback source={SPEAKER}.monitor sink={ROOM} "
                f"latency_msec={self.echo_delay_ms}\n"
            )
        script.write_text(
            f"load-module module-native-protocol-unix socket={self.socket} auth-anonymous=1\n"
            f"load-module module-null-sink sink_name={SPEAKER} rate={RATE} channels=1\n"
            f"{mic}"
            f"set-default-sink {SPEAKER}\n"
            f"set-default-source {MIC}\n"
        )
        # -n: no default.pa; --use-pid-file=no lets several servers (and root) coexist.
        command = [
            "pulseaudio",
            "--daemonize=no",
            "--exit-idle-time=-1",
            "-n",
            "-F",
            str(script),
            "--use-pid-file=no",
            "--log-target=stderr",
            "--log-level=error",
        ]
        self._server = subprocess.Popen(
            command,
            env=self.env(),
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "pulseaudio.log", "wb"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._server.poll() is not None:
                raise RuntimeError(f"pulseaudio exited: {self.log()}")
            ready = subprocess.run(
                ["pactl", "list", "short", "sources"],
                env=self.env(),
                capture_output=True,
                check=False,
                text=True,
            )
            if ready.returncode == 0 and MIC in ready.stdout and self._room_settled():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"pulseaudio did not come up: {self.log()}")

    def _room_settled(self) -> bool:
        """Whether the acoustic loop (if any) has drained its start-up buffer. The loopback
        starts with about 2 s queued in the room (the idle null sink's latency) and drains it
        over 2 s; a stream opened meanwhile starts late and reports the mic's latency off by
        up to 0.5 s, converging block by block, which the echo canceller's alignment takes
        for lost microphone audio: the loop's first client then hears its echo uncancelled.
        So the server is handed out only once the loopback's sink latency is down."""
        if self.echo_delay_ms is None:
            return True
        inputs = subprocess.run(
            ["pactl", "list", "sink-inputs"],
            env={**self.env(), "LC_ALL": "C"},  # the labels parsed below, untranslated
            capture_output=True,
            check=False,
            text=True,
        ).stdout
        latencies = [
            int(line.split()[2]) for line in inputs.splitlines() if "Sink Latency:" in line
        ]
        return bool(latencies) and max(latencies) < _SETTLED_USEC

    def log(self) -> str:
        path = self.root / "pulseaudio.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def feed_mic(self, pcm: np.ndarray, then_silence: bool = True) -> None:
        """Write float `pcm` (24 kHz) into the virtual mic at real-time pace in 20 ms chunks,
        then silence until `close()` or the next `feed_mic`. (The pipe source delivers only
        what is written.) With an acoustic loop, `pcm` is played into the room instead."""
        data = _to_s16(pcm)
        if self.echo_delay_ms is not None:
            self._play_into_room(data)
            return
        self._end_feeding()  # one writer at a time: two would interleave their blocks
        chunk = RATE // 50

        def run() -> None:
            with open(self.fifo, "wb", buffering=0) as fifo:
                start = time.monotonic()
                written = 0
                silence = np.zeros(chunk, "<i2").tobytes()
                while not self._stop_feeding.is_set():
                    if written < len(data):
                        block = data[written : written + chunk].tobytes()
                    elif then_silence:
                        block = silence
                    else:
                        return
                    try:
                        fifo.write(block)
                    except BrokenPipeError:
                        return
                    written += chunk
                    ahead = start + written / RATE - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)

        self._feeder = threading.Thread(target=run, daemon=True)
        self._feeder.start()

    def _end_feeding(self) -> None:
        """Stop the writer of the previous `feed_mic`, if any."""
        if self._feeder is not None:
            self._stop_feeding.set()
            self._feeder.join(2)
            self._feeder = None
        self._stop_feeding.clear()

    def _play_into_room(self, data: np.ndarray) -> None:
        command = [
            "pacat",
            "--playback",
            "-d",
            ROOM,
            "--raw",
            "--format",
            "s16le",
            "--rate",
            str(RATE),
            "--channels",
            "1",
            "--latency-msec",
            "20",
        ]
        self._player = subprocess.Popen(command, env=self.env(), stdin=subprocess.PIPE)
        self._player.stdin.write(data.tobytes())
        self._player.stdin.close()

    def start_recording(self, path: Path) -> None:
        """Record the speaker (null sink monitor) into `path` as raw s16le mono 24 kHz."""
        command = [
            "parec",
            "-d",
            f"{SPEAKER}.monitor",
            "--rate",
            str(RATE),
            "--channels",
            "1",
            "--format",
            "s16le",
            "--raw",
            "--latency-msec",
            "20",
        ]
        self._recorder = subprocess.Popen(
            command,
            env=self.env(),
            stdout=open(path, "wb"),  # noqa: SIM115
        )

    def stop_recording(self) -> None:
        if self._recorder is not None:
            self._recorder.terminate()
            self._recorder.wait(5)
            self._recorder = None

    def close(self) -> None:
        self._stop_feeding.set()
        self.stop_recording()
        if self._player is not None:
            self._player.kill()
            self._player.wait(5)
        if self._server is not None:
            self._server.terminate()
            try:
                self._server.wait(5)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait(5)
            self._server = None
        if self._feeder is not None:
            self._feeder.join(2)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()
