"""Talk to any LLM through the microphone and speakers: Kyutai's STT hears you, an mlx-lm
model answers, Kyutai's TTS speaks; interrupt it at any time.

    python -m moshi_mlx assistant [--llm REPO|FOLDER] [--system TEXT|@FILE] [device flags]

Echo cancellation (WebRTC AEC3) is on, so laptop speakers work; `--no-echo-cancel` turns it
off for headphones. Ctrl-C ends the conversation (exit code 0; the transcript is kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from moshi_mlx.assistant import Assistant, History, ReplySampling, TurnRules
from moshi_mlx.assistant.latency import TurnLatency
from moshi_mlx.assistant.pipeline import AssistantWords, Event, Notice, UserWords
from moshi_mlx.assistant.turns import AnswerEnded, UserSaid
from moshi_mlx.audio.devices import (
    device_name,
    format_devices,
    import_sounddevice,
    open_failure,
    resolve_device,
)
from moshi_mlx.audio.live import LiveLoop
from moshi_mlx.cli.assistant_models import (
    add_model_flags,
    load_models,
    print_memory_plan,
    read_system_prompt,
)
from moshi_mlx.cli.common import (
    CliParser,
    add_max_lag_arg,
    bounded,
    exit_at_once,
    invoked_as,
    max_lag_frames,
    non_negative_float,
    run_cli,
)
from moshi_mlx.cli.local import _STOP_SIGNALS as STOP_SIGNALS
from moshi_mlx.cli.local import _check_new_file as check_new_file
from moshi_mlx.cli.local import _echo_canceller as echo_canceller
from moshi_mlx.cli.local import _Outputs as Outputs
from moshi_mlx.cli.local import _status as status
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.model_thread import FRAME_SECONDS, ModelThread

WORKER_NAME = "assistant-audio"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(
        prog=invoked_as("assistant"),
        description="Talk to an LLM with Kyutai's STT and TTS; interrupt it any time "
        "(Ctrl-C to stop).",
    )
    audio = parser.add_argument_group("audio")
    audio.add_argument("--list-devices", action="store_true", help="list sound devices and exit")
    audio.add_argument("--input-device", metavar="DEVICE", help="microphone: index or name part")
    audio.add_argument("--output-device", metavar="DEVICE", help="speaker: index or name part")
    audio.add_argument(
        "--no-echo-cancel",
        dest="echo_cancel",
        action="store_false",
        help="turn echo cancellation off (with headphones)",
    )
    audio.add_argument("--denoise", action="store_true", help="suppress steady background noise")
    add_max_lag_arg(audio)
    audio.add_argument(
        "--record",
        metavar="FILE.wav",
        help="write a new wav: left the mic after echo cancellation, right the assistant",
    )
    audio.add_argument("--transcript", metavar="FILE", help="write both sides' words to a file")
    audio.add_argument(
        "--stats", metavar="FILE.json", help="write each answer's latency split and the cadence"
    )
    add_model_flags(parser)
    turns = parser.add_argument_group("turn-taking (Unmute's rules)")
    turns.add_argument(
        "--pause-threshold",
        type=bounded(float, 0, 1),
        default=TurnRules.pause_threshold,
        metavar="P",
        help="the turn ends when the STT's pause head says 'done' above P (default %(default)s)",
    )
    turns.add_argument(
        "--ignore-start",
        type=non_negative_float,
        default=TurnRules.ignore_start,
        metavar="SECONDS",
        help="the pause head is not read in the stream's first SECONDS (default %(default)s)",
    )
    turns.add_argument(
        "--barge-in-below",
        type=bounded(float, 0, 1),
        default=TurnRules.barge_in_below,
        metavar="P",
        help="while answering, a pause head 'done' below P interrupts it as a word does "
        "(default %(default)s; 0: words only)",
    )
    turns.add_argument(
        "--word-gap",
        type=non_negative_float,
        default=TurnRules.word_gap,
        metavar="SECONDS",
        help="an STT without pause heads (kyutai/stt-2.6b-en): the turn ends after SECONDS "
        "without a new word (default %(default)s)",
    )
    return parser.parse_args(argv)


class _Screen:
    """Both sides' words on stdout (and in the transcript), one line per turn: a line ends
    when its turn does (an answer cut off by the user ends with " —[cut off]")."""

    def __init__(self, outputs: Outputs):
        self._outputs = outputs
        self._role: str | None = None  # whose words the open line holds (None: no line open)

    def event(self, event: Event) -> None:
        if isinstance(event, UserWords):
            self._say("you", event.text)
        elif isinstance(event, AssistantWords):
            self._say("assistant", event.text)
        elif isinstance(event, UserSaid | AnswerEnded):
            if self._role is not None:
                cut_off = isinstance(event, AnswerEnded) and event.cut_off
                self._outputs.text(" —[cut off]\n" if cut_off else "\n")
            self._role = None
        elif isinstance(event, TurnLatency):
            status(event.line())
        elif isinstance(event, Notice):
            status(event.text)

    def _say(self, role: str, text: str) -> None:
        if role != self._role:
            self._outputs.text(("\n" if self._role is not None else "") + f"{role}: ")
            self._role = role
        else:
            self._outputs.text(" ")
        self._outputs.text(text)


class AssistantSession:
    """Devices, streams, the model thread, the audio worker and the conversation."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.thread = ModelThread()
        self.loop: LiveLoop | None = None
        self.assistant: Assistant | None = None
        self.worker: threading.Thread | None = None

    def run(self) -> int:
        args = self.args
        if args.list_devices:
            print(format_devices())
            return 0
        if args.memory_plan:
            return print_memory_plan(args)
        system = read_system_prompt(args.system)
        sd = import_sounddevice()
        resolve_device(args.input_device, "input")  # bad device flags fail before loading
        resolve_device(args.output_device, "output")
        check_new_file(args.record, "--record")
        check_new_file(args.transcript, "--transcript")
        echo = echo_canceller(args)
        self.thread.start()
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
        try:
            models = load_models(args, self.thread, system, stop)
            if models is None:
                print("interrupted", file=sys.stderr)
                return 130
            outputs = Outputs(args.record, args.transcript)
            try:
                asyncio.run(self._converse(sd, models, system, echo, outputs, stop))
            finally:
                outputs.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._finish()

    async def _converse(self, sd, models, system, echo, outputs, stop) -> None:
        args = self.args
        screen = _Screen(outputs)
        self.loop = loop = LiveLoop(
            lambda pcm: (self.assistant.exchange(pcm), ""),
            max_lag_frames=max_lag_frames(args),
            on_frames=outputs.frames,
            on_status=status,
            echo=echo,
        )
        self.assistant = Assistant(
            self.thread,
            models.stt,
            models.llm,
            models.make_speech,
            History(system),
            rules=TurnRules(
                args.pause_threshold,
                args.ignore_start,
                args.barge_in_below,
                word_gap=args.word_gap,
            ),
            sampling=ReplySampling(args.temp, args.top_p, args.max_tokens),
            on_event=screen.event,
            speaker_delay=lambda: (len(loop.speaker) + 0.5) * FRAME_SECONDS + loop.output_latency,
        )
        streams = _open_streams(sd, loop, args)
        try:
            loop.input_latency, loop.output_latency = streams[0].latency, streams[1].latency
            await self.assistant.start(greeting=args.greeting)
            self.worker = threading.Thread(target=loop.run, name=WORKER_NAME, daemon=True)
            self.worker.start()
            for stream in streams:
                stream.start()
            print(
                f"talking: mic {device_name(streams[0].device)!r} -> {models.names} -> speaker "
                f"{device_name(streams[1].device)!r} (echo cancellation "
                f"{'on' if echo is not None and echo.cancel_echo else 'off'}); Ctrl-C to stop",
                file=sys.stderr,
                flush=True,
            )
            while not stop.is_set() and not loop.stop_event.is_set():
                await asyncio.sleep(0.05)
        finally:
            loop.stop_event.set()
            for stream in streams:
                stream.abort()
                stream.close()
            await self.assistant.close()

    def _finish(self) -> int:
        print()
        if self.loop is None:
            return 0
        latencies = self.assistant.latencies
        stats = self.loop.stats()
        print(f"summary: {latencies.summary()}; {stats.summary()}", file=sys.stderr, flush=True)
        if self.args.stats:
            data = {**stats.as_dict(), "answers": latencies.as_dict()}
            Path(self.args.stats).write_text(json.dumps(data))
        if self.loop.error is not None:
            raise self.loop.error
        return 0


def _open_streams(sd, loop: LiveLoop, args: argparse.Namespace) -> list:
    common = {"samplerate": SAMPLE_RATE, "blocksize": FRAME_SIZE, "channels": 1}
    devices = {
        "input": resolve_device(args.input_device, "input"),
        "output": resolve_device(args.output_device, "output"),
    }
    streams = []
    try:
        streams.append(
            sd.InputStream(
                device=devices["input"], callback=loop.input_callback, dtype="float32", **common
            )
        )
        streams.append(
            sd.OutputStream(
                device=devices["output"], callback=loop.output_callback, dtype="float32", **common
            )
        )
    except sd.PortAudioError as exc:
        for stream in streams:
            stream.close()
        kind = "output" if streams else "input"
        raise open_failure(kind, devices[kind], exc) from None
    return streams


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx assistant`."""

    def command(rest: Sequence[str] | None) -> int:
        session = AssistantSession(parse_args(rest))
        code = session.run()
        if session.worker is not None:
            exit_at_once(code)  # MLX and PortAudio teardown would delay Ctrl-C's exit
        return code

    return run_cli(command, argv)
