"""`python -m moshi_mlx stt`: transcribe files, live captions from the microphone, or serve
Kyutai's streaming speech-to-text websocket.

    python -m moshi_mlx stt talk.wav other.flac [--json | --srt] [-o DIR] [--batch 8]
        [--tokens steps.npz]
    python -m moshi_mlx stt --mic [--input-device NAME]
    python -m moshi_mlx stt --serve [--port 8080]   (a preset of `serve --stt`)
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.audio.devices import (
    format_devices,
    import_sounddevice,
    open_failure,
    resolve_device,
)
from moshi_mlx.audio.wav import read_audio
from moshi_mlx.checkpoints.spec import DEFAULT_STT_REPO
from moshi_mlx.cli.common import (
    CliParser,
    SamplingDefaults,
    add_alias,
    add_sampling_args,
    add_weight_args,
    file_options,
    invoked_as,
    positive_int,
    progress_bar,
    run_cli,
)
from moshi_mlx.cli.tokens import NO_TOKEN, check_tokens_output, write_tokens
from moshi_mlx.errors import ConfigError
from moshi_mlx.files import check_output, written_atomically
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.sampling import GREEDY, Sampling
from moshi_mlx.stt.events import EndOfTurn, SttStep
from moshi_mlx.stt.transcriber import SttModel, Transcription, transcribe_steps
from moshi_mlx.stt.transcript import to_json, to_srt, to_text
from moshi_mlx.stt.words import finished_words

FORMATS = {"text": (to_text, ".txt"), "json": (to_json, ".json"), "srt": (to_srt, ".srt")}
END_OF_TURN = " [end of turn]\n"
PAUSE_HEADS_REPO = "kyutai/stt-1b-en_fr-candle"  # the published STT with pause heads
AUDIO_BAR = "{l_bar}{bar}| {n:.1f}/{total:.1f} s of audio [{elapsed}<{remaining}]"


STT_SAMPLING = SamplingDefaults(
    why="Kyutai's STT decodes greedily (temperature 0): a transcript has one right answer, "
    "and sampling only adds mistakes",
    text_temp=GREEDY.temp,
    text_top_k=GREEDY.top_k,
    seed=False,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(prog=invoked_as("stt"), description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="audio files to transcribe (wav, flac, ogg)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--mic", action="store_true", help="live captions from the microphone")
    mode.add_argument(
        "--serve",
        action="store_true",
        help="serve Kyutai's STT websocket: `serve --stt` on port 8080, with every flag of "
        "serve (see `stt --serve --help`)",
    )
    out = parser.add_argument_group("files")
    style = out.add_mutually_exclusive_group()
    style.add_argument("--json", action="store_true", help="words with start and end times")
    style.add_argument("--srt", action="store_true", help="subtitles")
    out.add_argument(
        "-o", "--output", metavar="DIR", help="write FILE.txt/.json/.srt here, not stdout"
    )
    add_alias(out, "--output-dir", dest="output")
    out.add_argument("--force", action="store_true", help="overwrite existing outputs")
    out.add_argument(
        "--tokens",
        metavar="FILE.npz",
        help="also write every step's tokens, one row per file in the order given: "
        "text_tokens (N, T) int32 (-1: no token, while the delays fill or past the file's "
        "end), pause_probs (N, T, H) float32 (each voice-activity head's 'done' probability; "
        "NaN: none), steps (N,) each file's steps, from step 0: prefix_steps of silence first",
    )
    out.add_argument(
        "--batch",
        type=positive_int,
        default=8,
        metavar="N",
        help="files transcribed together in one batch (default %(default)s)",
    )
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar on stderr (default: when it is a terminal)",
    )
    add_weight_args(parser, DEFAULT_STT_REPO)
    add_sampling_args(parser, STT_SAMPLING)
    audio = parser.add_argument_group("microphone")
    audio.add_argument("--list-devices", action="store_true", help="list sound devices and exit")
    audio.add_argument("--input-device", metavar="DEVICE", help="index or part of the name")
    audio.add_argument(
        "--vad",
        action="store_true",
        help="mark the ends of turns (the pause head's); a model without pause heads, such "
        "as kyutai/stt-2.6b-en, is refused",
    )
    args = parser.parse_args(argv)
    if not (args.files or args.mic or args.list_devices):
        parser.error("give audio files, --mic or --serve")
    if args.files and args.mic:
        parser.error("files cannot be combined with --mic")
    if args.vad and not args.mic:
        parser.error("--vad marks the ends of turns of --mic")
    if args.tokens and not args.files:
        parser.error("--tokens writes the tokens of files; give audio files")
    return args


def _load(args: argparse.Namespace) -> SttModel:
    return SttModel.load(args.hf_repo, **file_options(args))


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(args.text_temp, args.text_top_k)


def transcribe_files(args: argparse.Namespace) -> int:
    """Transcribe every file, in batches, and print or write the transcripts."""
    style = "json" if args.json else "srt" if args.srt else "text"
    render, suffix = FORMATS[style]
    paths = [Path(f) for f in args.files]
    outputs = []
    if args.output is not None:
        folder = Path(args.output)
        try:  # a missing folder is made, as `tts -o out/` makes it
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"-o {folder}: cannot make that folder ({exc.strerror})") from None
        outputs = [folder / (p.stem + suffix) for p in paths]
        for path, output in zip(paths, outputs):
            check_output(path, output, args.force, "audio file")
    elif style == "srt" and len(paths) > 1:
        raise ConfigError("--srt of several files needs -o DIR (one subtitle file each)")
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, paths, args.force, "audio file")
    audio = [read_audio(p, SAMPLE_RATE) for p in paths]  # every file read before the model
    model = _load(args)
    started = time.monotonic()
    seconds = sum(len(a) for a in audio) / SAMPLE_RATE
    with progress_bar(
        args.progress, total=round(seconds, 2), unit="s", bar_format=AUDIO_BAR, leave=False
    ) as bar:
        frame_seconds = FRAME_SIZE / SAMPLE_RATE
        transcriptions = transcribe_steps(
            model, audio, args.batch, _sampling(args), lambda n: bar.update(n * frame_seconds)
        )
    events = [transcription.events for transcription in transcriptions]
    print(
        f"transcribed {seconds:.1f} s of audio in {time.monotonic() - started:.1f} s",
        file=sys.stderr,
    )
    for index, (path, stream) in enumerate(zip(paths, events)):
        text = render(finished_words(stream))
        if outputs:
            with written_atomically(outputs[index]) as part:
                part.write_text(text)
        elif style == "json" and len(paths) > 1:
            print(json.dumps({"file": str(path), **json.loads(text)}, ensure_ascii=False))
        else:
            if len(paths) > 1:
                print(f"== {path}")
            print(text.rstrip("\n"))
    if tokens is not None:
        write_tokens(tokens, step_tokens(transcriptions, model.silence_prefix_steps))
    return 0


def step_tokens(transcriptions: list[Transcription], prefix_steps: int) -> dict[str, np.ndarray]:
    """The `--tokens` arrays of the files' transcriptions (see its help)."""
    lengths = [len(t.steps) for t in transcriptions]
    heads = max((len(s.pause_probabilities) for t in transcriptions for s in t.steps), default=0)
    text_tokens = np.full((len(transcriptions), max(lengths, default=0)), NO_TOKEN, np.int32)
    pause_probs = np.full((*text_tokens.shape, heads), np.nan, np.float32)
    for row, transcription in enumerate(transcriptions):
        for column, step in enumerate(transcription.steps):
            if step.text_token is not None:
                text_tokens[row, column] = step.text_token
            if step.pause_probabilities:
                pause_probs[row, column] = step.pause_probabilities
    return {
        "text_tokens": text_tokens,
        "pause_probs": pause_probs,
        "steps": np.array(lengths, np.int32),
        "prefix_steps": np.array(prefix_steps, np.int32),
    }


def caption(step: SttStep) -> str:
    """What live captions print for one step: its text, then `END_OF_TURN` when the
    voice-activity heads hear the speaker finish."""
    if any(isinstance(event, EndOfTurn) for event in step.events):
        return step.text + END_OF_TURN
    return step.text


def live_captions(args: argparse.Namespace) -> int:
    """Print the microphone's `caption` of each step as it is said; Ctrl-C ends the captions
    (exit code 0)."""
    sd = import_sounddevice()
    device = resolve_device(args.input_device, "input")
    model = _load(args)
    if args.vad and not model.has_pause_heads:
        raise ConfigError(
            f"--vad needs an STT model with pause heads, such as {PAUSE_HEADS_REPO}; "
            "this model has none"
        )
    stt = model.speech_to_text(text_sampling=_sampling(args))
    frames: queue.Queue[np.ndarray] = queue.Queue(maxsize=64)

    def on_audio(indata, _frames, _time, _status) -> None:  # PortAudio's thread: never blocks
        try:
            frames.put_nowait(indata[:, 0].copy())
        except queue.Full:  # the model fell behind: this frame is dropped
            pass

    try:
        stream = sd.InputStream(
            samplerate=SAMPLE_RATE,
            channels=1,
            dtype="float32",
            blocksize=FRAME_SIZE,
            device=device,
            callback=on_audio,
        )
    except sd.PortAudioError as exc:
        raise open_failure("input", device, exc) from None
    try:
        with stream:
            print("listening (Ctrl-C to stop)", file=sys.stderr)
            while True:
                print(caption(stt.step(frames.get())), end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: how live captions end, not an interruption
        print(flush=True)
    return 0


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.list_devices:
        print(format_devices())
        return 0
    if args.mic:
        return live_captions(args)
    return transcribe_files(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx stt`; `--serve` runs `serve`'s STT preset."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--serve" in args:
        from moshi_mlx.cli import serve  # the server's imports only for it

        args.remove("--serve")
        return serve.main(args, serve.STT)
    return run_cli(_run, args)
