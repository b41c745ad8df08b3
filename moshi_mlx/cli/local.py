"""Talk with Moshi through the microphone and speakers.

    python -m moshi_mlx.local [--input-device NAME] [--output-device NAME] [weight flags]

PersonaPlex takes a voice and a role (`--voice NATF2 --role "You are ..."`). Moshi's words are printed as it says them. Ctrl-C ends the conversation. Echo cancellation
(WebRTC AEC3) is on, so laptop speakers work; `--no-echo-cancel` turns it off for headphones.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.audio.devices import (
    device_name,
    format_devices,
    import_sounddevice,
    open_failure,
    resolve_device,
)
from moshi_mlx.audio.echo import EchoCanceller
from moshi_mlx.audio.live import LiveLoop
from moshi_mlx.audio.wav import WavRecorder
from moshi_mlx.cli.chat_flags import (
    add_model_args,
    add_persona_args,
    check_persona_args,
    conversation_options,
    load_model,
    print_memory_plan,
    print_voice_names,
    sampling_from_args,
)
from moshi_mlx.cli.common import (
    INTERRUPTED_EXIT,
    CliParser,
    add_max_lag_arg,
    as_flag,
    exit_at_once,
    invoked_as,
    log_to_stderr,
    max_lag_frames,
    run_cli,
)
from moshi_mlx.errors import AudioError
from moshi_mlx.files import folder_problem
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.memory_plan import wired_memory

WORKER_NAME = "moshi-worker"
_WORKER_GRACE = 0.2  # seconds to let a running model step finish after Ctrl-C


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(
        prog=invoked_as("local"),
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
        "--no-echo-cancel",
        dest="echo_cancel",
        action="store_false",
        help="turn echo cancellation off (with headphones)",
    )
    audio.add_argument(
        "--denoise", action="store_true", help="suppress steady background noise in the mic"
    )
    add_max_lag_arg(audio)
    audio.add_argument(
        "--record",
        metavar="FILE.wav",
        help="write a new wav: left what Moshi heard (the mic after echo cancellation), "
        "right Moshi (past 12 h, it goes on in FILE.part2.wav, ...)",
    )
    audio.add_argument("--transcript", metavar="FILE", help="write Moshi's text to a new file")
    audio.add_argument(
        "--stats", metavar="FILE.json", help="write measured cadence, latency and lag as JSON"
    )
    add_model_args(parser)
    add_persona_args(parser)
    return parser.parse_args(argv)


def _check_new_file(path: str | None, flag: str) -> None:
    """Before the model loads: `path` must be new, in a folder that exists and is writable."""
    if path is None:
        return
    if Path(path).exists():
        raise AudioError(f"{flag} {path} already exists; give a new file name or remove it first")
    if problem := folder_problem(Path(path)):
        raise AudioError(f"{flag} {path}: {problem}")


class _Outputs:
    """Text and recording sinks, written by the worker and closed once by the main thread.

    Each piece of text is flushed as it is printed and the recording's header is brought up
    to date every second, so both files stay readable whatever ends the process.
    """

    def __init__(self, record: str | None, transcript: str | None):
        self._lock = threading.Lock()
        self._recorder = WavRecorder(record, channels=2) if record else None
        self._transcript = None
        if transcript:
            try:
                self._transcript = open(transcript, "x", encoding="utf-8")  # noqa: SIM115
            except OSError as exc:
                if self._recorder is not None:
                    self._recorder.close()
                reason = "it exists" if isinstance(exc, FileExistsError) else exc.strerror
                raise AudioError(f"cannot create transcript {transcript}: {reason}") from None
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
            if self._closed:
                return
            self._closed = True
            if self._recorder is not None:
                self._recorder.close()
            if self._transcript is not None:
                self._transcript.write("\n")
                self._transcript.close()


def _status(message: str) -> None:
    print(f"\n[{message}]", file=sys.stderr, flush=True)


def _echo_canceller(args: argparse.Namespace) -> EchoCanceller | None:
    """The canceller the flags ask for; without its package, say so and go on without."""
    if not args.echo_cancel and not args.denoise:
        return None
    try:
        return EchoCanceller(SAMPLE_RATE, denoise=args.denoise, cancel_echo=args.echo_cancel)
    except AudioError as exc:
        _status(f"{exc.spelled(as_flag)}; going on without it: use headphones")
        return None


class LiveSession:
    """One live conversation: devices, streams, the model's worker thread, signal handlers
    and the output files.

    All MLX work (loading the model, warming it up, every step) runs on the worker thread;
    the main thread handles the flags, devices, streams and signals.
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.echo: EchoCanceller | None = None
        self.loop: LiveLoop | None = None
        self.worker: threading.Thread | None = None
        self._conversation = None
        self._model_name = ""  # set with the conversation, once the model is loaded
        self._outputs: _Outputs | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None

    # --- worker thread ------------------------------------------------------------------
    def _work(self) -> None:
        """Load and warm up the model, compute PersonaPlex's prompt, then run the live loop,
        all on this thread."""
        args = self.args
        try:
            model = load_model(args)
            model.check_prompt_choice(args.voice, args.role)  # before the warm-up's seconds
            model.warm_up(*sampling_from_args(args), args.cfg_coef)
            conversation = model.conversation(**conversation_options(args))
        except Exception as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self._load_error = exc
            self.loop.stop_event.set()
            return
        self._conversation = conversation
        self._model_name = model.lm.config.model_name
        self._ready.set()
        with wired_memory(model.memory):  # Apple GPUs: keep the model resident while talking
            self.loop.run()

    def _step(self, pcm: np.ndarray) -> tuple[np.ndarray, str]:
        result = self._conversation.step(pcm)
        return result.pcm, result.text

    def _text(self, text: str) -> None:
        self._outputs.text(text)

    def _frames(self, mic: np.ndarray, reply: np.ndarray) -> None:
        self._outputs.frames(mic, reply)

    # --- main thread --------------------------------------------------------------------
    def _open_streams(self, sd, input_device: int, output_device: int) -> list:
        common = {
            "samplerate": SAMPLE_RATE,
            "blocksize": FRAME_SIZE,
            "channels": 1,
            "dtype": "float32",
        }
        streams = []
        try:
            streams.append(
                sd.InputStream(device=input_device, callback=self.loop.input_callback, **common)
            )
            streams.append(
                sd.OutputStream(device=output_device, callback=self.loop.output_callback, **common)
            )
        except sd.PortAudioError as exc:
            for stream in streams:
                stream.close()
            kind, index = ("input", input_device) if not streams else ("output", output_device)
            raise open_failure(kind, index, exc) from None
        return streams

    def run(self) -> int:
        """Hold the conversation until Ctrl-C (or SIGTERM); the exit code."""
        args = self.args
        if args.list_devices:
            print(format_devices())
            return 0
        if args.memory_plan:
            return print_memory_plan(args)
        if args.list_voices:
            return print_voice_names(args)
        check_persona_args(args)
        log_to_stderr()  # PersonaPlex: how long its prompt took, or that it was cached
        sd = import_sounddevice()
        input_device = resolve_device(args.input_device, "input")
        output_device = resolve_device(args.output_device, "output")
        _check_new_file(args.record, "--record")
        _check_new_file(args.transcript, "--transcript")
        self.echo = _echo_canceller(args)
        self.loop = LiveLoop(
            self._step,
            frame_size=FRAME_SIZE,
            sample_rate=SAMPLE_RATE,
            max_lag_frames=max_lag_frames(args),
            on_text=self._text,
            on_frames=self._frames,
            on_status=_status,
            echo=self.echo,
        )
        streams = self._open_streams(sd, input_device, output_device)
        stop = self.loop.stop_event
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
        try:
            self.worker = threading.Thread(target=self._work, name=WORKER_NAME, daemon=True)
            self.worker.start()
            print("[loading the model...]", file=sys.stderr, flush=True)
            while not self._ready.wait(0.05):
                if stop.is_set():
                    break
            if not self._ready.is_set():
                if self._load_error is not None:
                    raise self._load_error
                print("interrupted", file=sys.stderr)
                return INTERRUPTED_EXIT
            self._converse(streams, input_device, output_device)
        finally:
            stop.set()
            for stream in streams:
                stream.abort()
                stream.close()
            if self.worker is not None:
                self.worker.join(_WORKER_GRACE)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._outputs is not None:
                self._outputs.close()
        return self._finish(streams)

    def _converse(self, streams: list, input_device: int, output_device: int) -> None:
        self._outputs = _Outputs(self.args.record, self.args.transcript)
        self.loop.input_latency = streams[0].latency
        self.loop.output_latency = streams[1].latency
        for stream in streams:
            stream.start()
        print(
            f"talking: mic {device_name(input_device)!r} -> {self._model_name} -> speaker "
            f"{device_name(output_device)!r} (seed {self._conversation.seed}, "
            f"{self._echo_label(streams)}); Ctrl-C to stop",
            file=sys.stderr,
            flush=True,
        )
        while not self.loop.stop_event.wait(0.05):
            pass

    def _echo_label(self, streams: list) -> str:
        if self.echo is None:
            return "echo cancellation off: use headphones"
        if not self.echo.cancel_echo:
            return "echo cancellation off, noise suppression on"
        delay_ms = 1000 * (streams[0].latency + streams[1].latency)
        extra = " and noise suppression" if self.echo.denoise else ""
        return f"echo cancellation{extra} on, stream delay {delay_ms:.0f} ms"

    def _finish(self, streams: list) -> int:
        loop = self.loop
        stats = loop.stats(
            latency_output_device_s=loop.output_latency,
            latency_input_device_s=loop.input_latency,
            echo_cancel=self.echo is not None and self.echo.cancel_echo,
        )
        print(f"\nsummary: {stats.summary()}", file=sys.stderr, flush=True)
        if self.args.stats:
            Path(self.args.stats).write_text(json.dumps(stats.as_dict()))
        if loop.error is not None:
            raise loop.error
        if not self.worker.is_alive():
            self._conversation.close()
            loop.close()
        return 0


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx.local`."""
    session = LiveSession(parse_args(argv))
    code = run_cli(lambda _: session.run(), None)
    if session.worker is not None:
        # Streams are shut and files closed. A model step (or the model's loading) may still be
        # running, and PortAudio/MLX teardown takes a good part of a second, while Ctrl-C must
        # end the app promptly.
        exit_at_once(code)
    return code
