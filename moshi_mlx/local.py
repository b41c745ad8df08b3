"""Talk with Moshi through the microphone and speakers.

    python -m moshi_mlx.local [--input-device NAME] [--output-device NAME] [weight flags]

Moshi's words are printed as it says them. Ctrl-C ends the conversation.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.audio.devices import device_name, format_devices, import_sounddevice, resolve_device
from moshi_mlx.audio.live import LiveLoop
from moshi_mlx.audio.wav import WavRecorder
from moshi_mlx.cli import add_model_args, load_model, run_cli, sampling_from_args
from moshi_mlx.errors import AudioError

WORKER_NAME = "moshi-worker"
_WORKER_GRACE = 0.2  # seconds to let a running model step finish after Ctrl-C


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moshi_mlx.local",
        description="Full-duplex voice conversation with Moshi (Ctrl-C to stop).",
    )
    audio = parser.add_argument_group("audio")
    audio.add_argument("--list-devices", action="store_true", help="list sound devices and exit")
    audio.add_argument(
        "--input-device", metavar="DEVICE", help="microphone: index or part of the name"
    )
    audio.add_argument(
        "--output-device", metavar="DEVICE", help="speaker: index or part of the name"
    )
    audio.add_argument(
        "--max-lag", type=float, default=0.24, metavar="SECONDS",
        help="seconds of mic audio the model may fall behind before the oldest is dropped",
    )  # fmt: skip
    audio.add_argument(
        "--record", metavar="FILE.wav", help="write both sides to this wav (left user, right Moshi)"
    )
    audio.add_argument("--transcript", metavar="FILE", help="write Moshi's text to this file")
    audio.add_argument(
        "--stats", metavar="FILE.json", help="write measured cadence, latency and lag as JSON"
    )
    add_model_args(parser)
    return parser.parse_args(argv)


class _Outputs:
    """Text and recording sinks, written by the worker and closed once by the main thread."""

    def __init__(self, record: str | None, transcript: str | None):
        self._lock = threading.Lock()
        self._recorder = WavRecorder(record, channels=2) if record else None
        try:
            # kept open for the whole session, closed by close()
            self._transcript = (
                open(transcript, "w", encoding="utf-8")  # noqa: SIM115
                if transcript else None
            )  # fmt: skip
        except OSError as exc:
            raise AudioError(f"cannot create transcript {transcript}: {exc.strerror}") from None
        self._closed = False

    def text(self, text: str) -> None:
        # Printed and saved together, so the transcript always equals what was shown.
        with self._lock:
            if self._closed:
                return
            sys.stdout.write(text)
            sys.stdout.flush()
            if self._transcript is not None:
                self._transcript.write(text)
                self._transcript.flush()

    def frames(self, mic: np.ndarray, reply: np.ndarray) -> None:
        with self._lock:
            if self._recorder is not None and not self._closed:
                self._recorder.write(mic, reply)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._recorder is not None:
                self._recorder.close()
            if self._transcript is not None:
                self._transcript.write("\n")
                self._transcript.close()


def _status(message: str) -> None:
    print(f"\n[{message}]", file=sys.stderr, flush=True)


def _open_streams(sd, loop: LiveLoop, input_device: int, output_device: int, frame_size: int):
    common = {"samplerate": 24_000, "blocksize": frame_size, "channels": 1, "dtype": "float32"}
    streams = []
    try:
        streams.append(sd.InputStream(device=input_device, callback=loop.input_callback, **common))
        streams.append(
            sd.OutputStream(device=output_device, callback=loop.output_callback, **common)
        )
    except sd.PortAudioError as exc:
        for stream in streams:
            stream.close()
        kind, index = ("input", input_device) if not streams else ("output", output_device)
        raise AudioError(
            f"cannot open {kind} device {index} ({device_name(index)}) at 24000 Hz, "
            f"mono: {exc}; choose another with --{kind}-device (see --list-devices)"
        ) from None
    return streams


def _run(argv: Sequence[str] | None, session: dict) -> int:
    args = parse_args(argv)
    if args.list_devices:
        print(format_devices())
        return 0
    sd = import_sounddevice()
    input_device = resolve_device(args.input_device, "input")
    output_device = resolve_device(args.output_device, "output")
    model = load_model(args)
    conversation = model.conversation(sampling=sampling_from_args(args), seed=args.seed)
    conversation.step(np.zeros(model.frame_size, np.float32))  # warm up (kernels, caches)
    conversation.reset()

    outputs = _Outputs(args.record, args.transcript)
    loop = LiveLoop(
        lambda pcm: _pcm_and_text(conversation.step(pcm)),
        frame_size=model.frame_size,
        sample_rate=model.sample_rate,
        max_lag_frames=max(1, round(args.max_lag * model.sample_rate / model.frame_size)),
        on_text=outputs.text, on_frames=outputs.frames, on_status=_status,
    )  # fmt: skip
    streams = _open_streams(sd, loop, input_device, output_device, model.frame_size)
    loop.output_latency = streams[1].latency
    worker = threading.Thread(target=loop.run, name=WORKER_NAME, daemon=True)
    session["streamed"] = True

    stop = loop.stop_event
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        worker.start()
        for stream in streams:
            stream.start()
        print(
            f"talking: mic {device_name(input_device)!r} -> Moshi -> speaker "
            f"{device_name(output_device)!r} (seed {conversation.seed}); Ctrl-C to stop",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        while not stop.wait(0.05):
            pass
    finally:
        stop.set()
        for stream in streams:
            stream.abort()
            stream.close()
        worker.join(_WORKER_GRACE)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        outputs.close()
    stats = loop.stats(latency_output_device_s=loop.output_latency)
    print(f"\nsummary: {stats.summary()}", file=sys.stderr, flush=True)
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats.as_dict()))
    if loop.error is not None:
        raise loop.error
    if not worker.is_alive():
        conversation.close()
        loop.close()
    return 0


def _pcm_and_text(result) -> tuple[np.ndarray, str]:
    return result.pcm, result.text


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx.local`."""
    session: dict = {}
    code = run_cli(lambda args: _run(args, session), argv)
    if session.get("streamed"):
        # Streams are shut and files closed. Leave at once: a model step may still be running
        # (up to seconds on a slow CPU) and PortAudio/MLX teardown takes a good part of a
        # second, while Ctrl-C must end the app promptly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
