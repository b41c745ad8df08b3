"""`python -m moshi_mlx.tts`: speak a text into a wav file or to the speakers, or a JSONL
batch of requests in one batch.

    python -m moshi_mlx.tts "Hello there." -o hello.wav [--voice NAME_OR_FILE]
    python -m moshi_mlx.tts - --play < story.txt          # stdin; plays as it is made
    python -m moshi_mlx.tts --text-file story.txt -o story.wav --words
    python -m moshi_mlx.tts --jsonl requests.jsonl --out-folder tts-outputs
    python -m moshi_mlx.tts "Hello there." -o hello.wav --tokens hello.npz  # every step's tokens

A JSONL line is Kyutai's `run_tts` request: {"turns": ["text", ...], "voices": ["name", ...],
"id": "output name"} (optionally "cfg_coef"); every line runs in one batch and gives
OUT_FOLDER/ID.wav and OUT_FOLDER/ID.json (the words and their start times).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.audio.devices import format_devices, import_sounddevice, open_failure, resolve_device
from moshi_mlx.audio.ring import FrameRing
from moshi_mlx.audio.wav import write_audio
from moshi_mlx.checkpoints.spec import DEFAULT_TTS_REPO
from moshi_mlx.cli.common import add_dtype_arg, run_cli
from moshi_mlx.cli.tokens import check_tokens_output, write_tokens
from moshi_mlx.errors import TtsError
from moshi_mlx.files import check_output, folder_problem, written_atomically
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.tts.stepper import TtsSampling
from moshi_mlx.tts.synthesizer import (
    DEFAULT_CFG_COEF,
    Speech,
    TokenLog,
    TtsModel,
    TtsRequest,
    TtsStream,
)
from moshi_mlx.tts.voices import DEFAULT_VOICE, DEFAULT_VOICE_REPO, MAX_SPEAKERS

PLAY_BUFFER_FRAMES = 50  # 4 s of audio queued for the speakers at most


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m moshi_mlx.tts", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("text", nargs="?", help="the text to speak; - reads it from stdin")
    parser.add_argument("--text-file", metavar="FILE", help="read the text from FILE")
    parser.add_argument("--jsonl", metavar="FILE", help="a batch of requests, one per line")
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--out", metavar="WAV", help="write the speech to this wav file")
    out.add_argument("--out-folder", metavar="DIR", default="tts-outputs", help="--jsonl output")
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
    voice = parser.add_argument_group("voice and sampling")
    voice.add_argument(
        "--voice",
        action="append",
        metavar="NAME",
        help=f"a voice of --voice-repo or a .safetensors file (up to {MAX_SPEAKERS}: one per "
        f"speaker; default {DEFAULT_VOICE})",
    )
    voice.add_argument("--voice-repo", default=DEFAULT_VOICE_REPO, help="Hugging Face voice repo")
    voice.add_argument("--cfg-coef", type=float, default=DEFAULT_CFG_COEF, help="guidance")
    voice.add_argument("--temp", type=float, default=0.6, help="sampling temperature")
    voice.add_argument("--padding-bonus", type=float, default=0.0, help="> 0 speaks slower")
    voice.add_argument("--seed", type=int, help="random seed (default: random)")
    voice.add_argument("--max-seconds", type=float, default=2400.0, help="stop after this much")
    model = parser.add_argument_group("model files (default: the hub repo's)")
    model.add_argument("--hf-repo", default=DEFAULT_TTS_REPO, help="Hugging Face model repo")
    model.add_argument("--moshi-weight", metavar="FILE", help="the TTS LM's weights")
    model.add_argument("--mimi-weight", metavar="FILE", help="Mimi's weights")
    model.add_argument("--tokenizer", metavar="FILE", help="the SentencePiece text tokenizer")
    model.add_argument("--lm-config", metavar="FILE", help="the model's config.json")
    add_dtype_arg(model)
    args = parser.parse_args(argv)
    if args.list_devices:
        return args
    inputs = [args.text is not None, args.text_file is not None, args.jsonl is not None]
    if sum(inputs) != 1:
        parser.error("give exactly one of TEXT, --text-file or --jsonl")
    if args.jsonl is None and not (args.out or args.play):
        parser.error("say where the speech goes: -o WAV and/or --play")
    if args.jsonl is not None and (args.out or args.play):
        parser.error("--jsonl writes into --out-folder; -o and --play are for one text")
    return args


def _read_text(args: argparse.Namespace) -> str:
    if args.text_file is not None:
        try:
            return Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TtsError(f"cannot read --text-file {args.text_file}: {exc}") from None
    return sys.stdin.read() if args.text == "-" else args.text


def _read_jsonl(path: str) -> list[tuple[str, TtsRequest]]:
    """(output name, request) of each line of a JSONL batch file."""
    requests = []
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
        if any(name == earlier for earlier, _ in requests):
            raise TtsError(f"{path}:{number}: id {name!r} is given twice")
        requests.append((name, TtsRequest(turns, tuple(voices), cfg_coef)))
    if not requests:
        raise TtsError(f"{path} holds no request")
    return requests


def _load(args: argparse.Namespace) -> TtsModel:
    return TtsModel.load(
        args.hf_repo,
        args.moshi_weight,
        args.mimi_weight,
        args.tokenizer,
        args.lm_config,
        voice_repo=args.voice_repo,
        dtype=args.dtype,
    )


def _sampling(args: argparse.Namespace) -> TtsSampling:
    return TtsSampling(temp=args.temp, padding_bonus=args.padding_bonus)


def _words_json(speech: Speech) -> str:
    words = [{"word": word, "start": round(start, 3)} for word, start in speech.words]
    return json.dumps({"words": words, "complete": speech.complete}, ensure_ascii=False)


def _run_batch(args: argparse.Namespace) -> int:
    named = _read_jsonl(args.jsonl)
    folder = Path(args.out_folder)
    folder.mkdir(parents=True, exist_ok=True)
    outputs = [(folder / f"{name}.wav", folder / f"{name}.json") for name, _ in named]
    for wav, words in outputs:
        for path in (wav, words):
            check_output(Path(args.jsonl), path, args.force, "JSONL file")
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, [Path(args.jsonl)], args.force, "JSONL file")
    model = _load(args)
    start = time.monotonic()
    max_steps = int(args.max_seconds * SAMPLE_RATE / FRAME_SIZE)
    speeches = model.synthesize([r for _, r in named], _sampling(args), args.seed, max_steps)
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
    blocking: silence while the ring is empty)."""

    def __init__(self, device: str | None):
        sd = import_sounddevice()
        index = resolve_device(device, "output")
        self.ring = FrameRing(PLAY_BUFFER_FRAMES, FRAME_SIZE)
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
        if frames != FRAME_SIZE or self.ring.pop_into(outdata[:, 0]) is None:
            outdata.fill(0)

    def play(self, pcm: np.ndarray) -> None:
        while not self.ring.push(pcm):  # the ring is full: the model is ahead, wait
            time.sleep(0.02)

    def finish(self) -> None:
        while len(self.ring):
            time.sleep(0.02)
        # The last frame has left the ring, not the speakers: stopping sooner cuts it off.
        time.sleep(self.stream.latency + 2 * FRAME_SIZE / SAMPLE_RATE)
        self.stream.stop()
        self.stream.close()


def _run_one(args: argparse.Namespace) -> int:
    text = _read_text(args)
    if not text.strip():
        raise TtsError("the text is empty")
    out = Path(args.out) if args.out else None
    if out is not None:
        check_output(Path(args.text_file or "-"), out, args.force, "text file")
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, [Path(args.text_file or "-")], args.force, "text file")
    voices = tuple(args.voice or (DEFAULT_VOICE,))
    model = _load(args)
    speaker = _Speaker(args.output_device) if args.play else None
    stream = model.stream(voices, args.cfg_coef, _sampling(args), args.seed)
    stream.push(text)
    stream.close()
    pcm = []
    log = TokenLog(model.config.dep_q)
    max_steps = int(args.max_seconds * SAMPLE_RATE / FRAME_SIZE)
    try:
        for step, frame in enumerate(_frames(stream, log)):
            if step >= max_steps:
                print(f"stopped after {args.max_seconds:g} s (--max-seconds)", file=sys.stderr)
                break
            if frame is None:
                continue
            pcm.append(frame)
            if speaker is not None:
                speaker.play(frame)
    finally:
        if speaker is not None:
            speaker.finish()
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
    return run_cli(command, argv)
