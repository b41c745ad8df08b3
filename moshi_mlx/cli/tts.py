"""`python -m moshi_mlx tts`: speak a text into a wav file or to the speakers, or a JSONL
batch of requests in one batch.

    python -m moshi_mlx tts "Hello there." -o hello.wav [--voice NAME_OR_FILE]
    python -m moshi_mlx tts - --play < story.txt          # stdin; plays as it is made
    python -m moshi_mlx tts --text-file story.txt -o story.wav --words
    python -m moshi_mlx tts --jsonl requests.jsonl -o tts-outputs
    python -m moshi_mlx tts "Hello there." -o hello.wav --tokens hello.npz  # every step's tokens

A JSONL line is Kyutai's `run_tts` request: {"turns": ["text", ...], "voices": ["name", ...],
"id": "output name"} (optionally "cfg_coef"); every line runs in one batch and gives
DIR/ID.wav and DIR/ID.json (the words and their start times), DIR being `-o` (default
tts-outputs). A voice may be a recording (.wav, .flac, ...; one per line, a relative path
found beside the JSONL file) whose voice the line's speech continues, as `--voice` takes one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from moshi_mlx.audio.devices import format_devices, import_sounddevice, open_failure, resolve_device
from moshi_mlx.audio.frame_queue import FrameQueue
from moshi_mlx.audio.wav import check_audio_name, read_audio, write_audio
from moshi_mlx.checkpoints.spec import DEFAULT_TTS_REPO, DEFAULT_VOICE_REPO
from moshi_mlx.cli.common import (
    CliParser,
    SamplingDefaults,
    add_alias,
    add_sampling_args,
    add_weight_args,
    invoked_as,
    non_negative_float,
    positive_float,
    positive_int,
    progress_bar,
    run_cli,
)
from moshi_mlx.cli.tokens import check_tokens_output, write_tokens
from moshi_mlx.errors import AudioError, TtsError
from moshi_mlx.files import check_output, folder_problem, written_atomically
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.runtime.speed_plan import SpeedPlan, plan_speed
from moshi_mlx.tts.prefix import check_recording, request_voices, split_recording
from moshi_mlx.tts.stepper import AUDIO_SAMPLING, TEXT_SAMPLING
from moshi_mlx.tts.synthesizer import (
    DEFAULT_CFG_COEF,
    Speech,
    TtsModel,
    TtsRequest,
    TtsStream,
)
from moshi_mlx.tts.token_log import TokenLog
from moshi_mlx.tts.voices import DEFAULT_VOICE, MAX_SPEAKERS, Voice

PLAY_BUFFER_FRAMES = 50  # 4 s of audio queued for the speakers at most


TTS_SAMPLING = SamplingDefaults(
    why="Kyutai's TTS (its config's lm_gen_config): one temperature, 0.6, for text and audio, "
    "cooler than chat's 0.8 for steadier speech; top-k as Moshi's",
    temp=AUDIO_SAMPLING.temp,
    temp_of="text and audio",
    top_k=AUDIO_SAMPLING.top_k,
    text_top_k=TEXT_SAMPLING.top_k,
)
JSONL_FOLDER = "tts-outputs"
SPEECH_BAR = "{n:.1f} s of speech [{elapsed}, {rate_fmt}]"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(prog=invoked_as("tts"), description=__doc__.split("\n\n")[0])
    parser.add_argument("text", nargs="?", help="the text to speak; - reads it from stdin")
    parser.add_argument("--text-file", metavar="FILE", help="read the text from FILE")
    parser.add_argument("--jsonl", metavar="FILE", help="a batch of requests, one per line")
    out = parser.add_argument_group("output")
    out.add_argument(
        "-o",
        "--output",
        metavar="WAV|DIR",
        help=f"the wav file of the speech; with --jsonl the folder (default {JSONL_FOLDER})",
    )
    add_alias(out, "--out", "--out-folder", dest="output")
    out.add_argument("--force", action="store_true", help="overwrite existing outputs")
    out.add_argument("--play", action="store_true", help="play the speech as it is made")
    out.add_argument(
        "--tokens",
        metavar="FILE.npz",
        help="also write every step's tokens, one row per request (1 for a text, the --jsonl "
        "lines in order): predicted_text_tokens (B, T) and fed_text_tokens (B, T) int32, the "
        "text token the model predicted and the one fed back, and audio_codes (B, K, F) int32, "
        "each frame's codes (F = T - the delays; -1: no audio yet)",
    )
    out.add_argument("--words", action="store_true", help="print each word's start time")
    out.add_argument("--output-device", metavar="DEVICE", help="speaker: index or part of name")
    out.add_argument("--list-devices", action="store_true", help="list sound devices and exit")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar on stderr (default: when it is a terminal)",
    )
    voice = parser.add_argument_group("voice")
    voice.add_argument(
        "--voice",
        action="append",
        metavar="NAME",
        help=f"a voice of --voice-repo or a .safetensors file (up to {MAX_SPEAKERS}: one per "
        f"speaker; default {DEFAULT_VOICE}), or a recording (.wav, .flac, ...) whose voice the "
        "speech continues (cloning: an audio prefix, a few seconds)",
    )
    voice.add_argument(
        "--voice-repo",
        default=DEFAULT_VOICE_REPO,
        metavar="REPO|FOLDER",
        help="the TTS voices (default %(default)s)",
    )
    voice.add_argument(
        "--cfg-coef",
        type=non_negative_float,
        default=DEFAULT_CFG_COEF,
        help="guidance: a value tts-1.6b was distilled for, or for tts-0.75b-en-public "
        "classifier-free guidance by a second batch row (1: none; default %(default)s)",
    )
    voice.add_argument(
        "--padding-bonus", type=float, default=0.0, help="> 0 speaks slower (default %(default)s)"
    )
    voice.add_argument(
        "--max-seconds",
        type=positive_float,
        default=2400.0,
        help="stop after this many seconds of speech (default %(default)s)",
    )
    voice.add_argument(
        "--n-q",
        type=positive_int,
        metavar="N",
        help="generate and decode the first N audio codebooks only (faster; default all, "
        "Kyutai's servers use 24 of 32)",
    )
    add_sampling_args(parser, TTS_SAMPLING)
    add_weight_args(parser, DEFAULT_TTS_REPO, codec=False)
    args = parser.parse_args(argv)
    if args.list_devices:
        return args
    inputs = [args.text is not None, args.text_file is not None, args.jsonl is not None]
    if sum(inputs) != 1:
        parser.error("give exactly one of TEXT, --text-file or --jsonl")
    if args.jsonl is None and not (args.output or args.play):
        parser.error("say where the speech goes: -o WAV and/or --play")
    if args.jsonl is not None and args.play:
        parser.error("--jsonl writes into the -o folder; --play is for one text")
    return args


def _read_text(args: argparse.Namespace) -> str:
    if args.text_file is not None:
        try:
            return Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TtsError(f"cannot read --text-file {args.text_file}: {exc}") from None
    return sys.stdin.read() if args.text == "-" else args.text


@dataclass(frozen=True)
class _Line:
    """A request of a JSONL batch file: its line's number, its output name, the request,
    and the recording it clones a voice from (None: none) and its samples (24 kHz)."""

    number: int
    name: str
    request: TtsRequest
    recording: Path | None = None
    pcm: np.ndarray | None = None
    named: tuple[Voice, ...] = ()  # the voices given by name or file, not the recording


def _read_jsonl(path: str) -> list[_Line]:
    """The requests of a JSONL batch file, one per line; a voice that is a recording is
    found beside the file (a relative path) and read here, so that a bad one stops the
    batch before the model loads."""
    requests: list[_Line] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TtsError(f"cannot read --jsonl {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            turns, name = data["turns"], str(data["id"])
            voices = data.get("voices") or [DEFAULT_VOICE]
            for key, value in (("turns", turns), ("voices", voices)):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise TypeError(f"{key} must be a list of strings")
            cfg_coef = float(data.get("cfg_coef", DEFAULT_CFG_COEF))
        except (ValueError, KeyError, TypeError) as exc:
            raise TtsError(f"{path}:{number}: not a request ({type(exc).__name__}: {exc})")
        if not name or Path(name).name != name or name.startswith("."):
            raise TtsError(f"{path}:{number}: id {name!r} is not a plain file name")
        if any(name == earlier.name for earlier in requests):
            raise TtsError(f"{path}:{number}: id {name!r} is given twice")
        try:
            voices, recording = split_recording(voices, Path(path).parent)
            pcm = None if recording is None else read_audio(recording, SAMPLE_RATE)
        except (TtsError, AudioError) as exc:
            raise TtsError(f"{path}:{number}: ", *exc.parts, parameter=exc.parameter) from None
        request = TtsRequest(turns, voices, cfg_coef)
        named = voices if len(data.get("voices") or ()) > (recording is not None) else ()
        requests.append(_Line(number, name, request, recording, pcm, named))
    if not requests:
        raise TtsError(f"{path} holds no request")
    return requests


def _request(model: TtsModel, path: str, line: _Line) -> TtsRequest:
    """The line's request, its voices checked (read, kept for the run) and the audio prefix
    of the recording it clones, if any; errors name the line."""
    try:
        check_recording(model.config, line.named, line.recording)
        for voice in () if model.clones_only else line.request.voices:
            model.voice(voice)
        if line.pcm is None:
            return line.request
        return replace(line.request, prefix=model.voice_prefix(line.pcm))
    except AudioError as exc:
        raise TtsError(f"{path}:{line.number}: {line.recording}: ", *exc.parts) from None
    except TtsError as exc:
        raise TtsError(f"{path}:{line.number}: ", *exc.parts, parameter=exc.parameter) from None


def _load(args: argparse.Namespace) -> TtsModel:
    model = TtsModel.load(
        args.hf_repo,
        moshi_weight=args.moshi_weight,
        mimi_weight=args.mimi_weight,
        tokenizer=args.tokenizer,
        lm_config=args.lm_config,
        voice_repo=args.voice_repo,
        dtype=args.dtype,
        n_q=args.n_q,
    )
    # Beside the progress bar (a terminal's): a refusal's error stays one line in logs.
    if args.progress or (args.progress is None and sys.stderr.isatty()):
        print(_speed_line(plan_speed(model.lm)), file=sys.stderr)
    return model


def _speed_line(plan: SpeedPlan) -> str:
    """The speed plan's line, its advice in flags."""
    line = plan.line()
    return line.replace("bits=8", "an 8-bit file (python -m moshi_mlx quantize)").replace(
        "n_q=", "--n-q "
    )


def _sampling(args: argparse.Namespace) -> dict[str, Sampling | float]:
    """The sampling flags as `TtsModel.synthesize`'s and `stream`'s keywords."""
    return {
        "text_sampling": Sampling(args.temp, args.text_top_k),
        "audio_sampling": Sampling(args.temp, args.top_k),
        "padding_bonus": args.padding_bonus,
    }


def _words_json(speech: Speech) -> str:
    words = [{"word": word, "start": round(start, 3)} for word, start in speech.words]
    return json.dumps({"words": words, "complete": speech.complete}, ensure_ascii=False)


def _run_batch(args: argparse.Namespace) -> int:
    lines = _read_jsonl(args.jsonl)
    folder = Path(args.output or JSONL_FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    outputs = [(folder / f"{line.name}.wav", folder / f"{line.name}.json") for line in lines]
    for wav, words in outputs:
        for path in (wav, words):
            check_output(Path(args.jsonl), path, args.force, "JSONL file")
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, [Path(args.jsonl)], args.force, "JSONL file")
    model = _load(args)
    requests = [_request(model, args.jsonl, line) for line in lines]
    start = time.monotonic()
    max_steps = int(args.max_seconds * SAMPLE_RATE / FRAME_SIZE)
    frame_seconds = FRAME_SIZE / SAMPLE_RATE
    with progress_bar(args.progress, unit="s", bar_format=SPEECH_BAR, leave=False) as bar:
        speeches = model.synthesize(
            requests,
            seed=args.seed,
            max_steps=max_steps,
            on_step=lambda: bar.update(frame_seconds),
            **_sampling(args),
        )
    seconds = sum(len(s.pcm) for s in speeches) / SAMPLE_RATE
    for (wav, words), speech in zip(outputs, speeches):
        with written_atomically(wav) as partial:
            write_audio(partial, speech.pcm, SAMPLE_RATE)
        with written_atomically(words) as partial:
            partial.write_text(_words_json(speech) + "\n")
        print(f"{wav} ({len(speech.pcm) / SAMPLE_RATE:.1f} s)")
    if tokens is not None:
        write_tokens(tokens, _speech_tokens(speeches))
    elapsed = time.monotonic() - start
    print(
        f"{len(speeches)} requests, {seconds:.1f} s of speech in {elapsed:.1f} s", file=sys.stderr
    )
    return 0


def _speech_tokens(speeches: list[Speech]) -> dict[str, np.ndarray]:
    """The `--tokens` arrays of a batch's speeches (see its help)."""
    return {
        "predicted_text_tokens": np.stack([s.predicted_tokens for s in speeches]),
        "fed_text_tokens": np.stack([s.fed_tokens for s in speeches]),
        "audio_codes": np.stack([s.audio_codes for s in speeches]),
    }


class _Speaker:
    """Plays frames as they come: the model thread pushes, PortAudio's callback pops (never
    blocking: silence while the queue is empty)."""

    def __init__(self, device: str | None):
        sd = import_sounddevice()
        index = resolve_device(device, "output")
        self.queue = FrameQueue(PLAY_BUFFER_FRAMES, FRAME_SIZE)
        try:
            self.stream = sd.OutputStream(
                device=index,
                samplerate=SAMPLE_RATE,
                channels=1,
                dtype="float32",
                blocksize=FRAME_SIZE,
                callback=self._callback,
            )
            self.stream.start()
        except Exception as exc:  # noqa: BLE001 - PortAudio's errors have no common type
            raise open_failure("output", index, exc) from None

    def _callback(self, outdata, frames, time_info, status) -> None:
        if frames != FRAME_SIZE or self.queue.pop_into(outdata[:, 0]) is None:
            outdata.fill(0)

    def play(self, pcm: np.ndarray) -> None:
        while not self.queue.push(pcm):  # the queue is full: the model is ahead, wait
            time.sleep(0.02)

    def finish(self) -> None:
        while len(self.queue):
            time.sleep(0.02)
        # The last frame has left the queue, not the speakers: stopping sooner cuts it off.
        time.sleep(self.stream.latency + 2 * FRAME_SIZE / SAMPLE_RATE)
        self.stream.stop()
        self.stream.close()


def _speak(
    frames: Iterator[np.ndarray | None],
    speaker: _Speaker | None,
    max_steps: int,
    progress: bool | None,
) -> tuple[list[np.ndarray], bool]:
    """The frames of the speech (`speaker` playing each) and whether it ended within
    `max_steps` steps."""
    pcm = []
    with progress_bar(progress, unit="s", bar_format=SPEECH_BAR, leave=False) as bar:
        for step, frame in enumerate(frames):
            if step == max_steps:
                return pcm, False
            if frame is None:
                continue
            bar.update(FRAME_SIZE / SAMPLE_RATE)
            pcm.append(frame)
            if speaker is not None:
                speaker.play(frame)
    return pcm, True


def _run_one(args: argparse.Namespace) -> int:
    text = _read_text(args)
    if not text.strip():
        raise TtsError("the text is empty")
    out = Path(args.output) if args.output else None
    if out is not None:
        check_output(Path(args.text_file or "-"), out, args.force, "text file")
        check_audio_name(args.output)
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, [Path(args.text_file or "-")], args.force, "text file")
    model = _load(args)
    voices, prefix = request_voices(args.voice or (), model.config, model.mimi)
    speaker = _Speaker(args.output_device) if args.play else None
    stream = model.stream(voices, args.cfg_coef, seed=args.seed, prefix=prefix, **_sampling(args))
    stream.push(text)
    stream.close()
    log = TokenLog(model.codebooks)
    max_steps = int(args.max_seconds * SAMPLE_RATE / FRAME_SIZE)
    try:
        pcm, ended = _speak(_frames(stream, log), speaker, max_steps, args.progress)
    finally:
        if speaker is not None:
            speaker.finish()
    if not ended:
        print(f"stopped after {args.max_seconds:g} s (--max-seconds)", file=sys.stderr)
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    if out is not None:
        if problem := folder_problem(out):
            raise TtsError(f"cannot write {out}: {problem}")
        with written_atomically(out) as partial:
            write_audio(partial, audio, SAMPLE_RATE)
        print(f"{out} ({len(audio) / SAMPLE_RATE:.1f} s)")
    if tokens is not None:
        write_tokens(tokens, log.arrays(1))
    if args.words:
        for word, start in stream.words:
            print(f"{start:7.2f}  {word}")
    return 0


def _frames(stream: TtsStream, log: TokenLog) -> Iterator[np.ndarray | None]:
    """`stream.frames()`, every step's tokens added to `log`."""
    for step in stream.steps():
        log.add(step.tokens)
        frame = step.pcm[0]
        if frame is not None or stream.waiting:
            yield frame


def command(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_devices:
        print(format_devices())
        return 0
    return _run_batch(args) if args.jsonl is not None else _run_one(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx tts` (`moshi-mlx-tts`)."""
    return run_cli(command, argv)
