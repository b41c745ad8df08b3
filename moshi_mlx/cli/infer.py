"""Offline conversation: stream a wav file through Moshi as if live, write Moshi's side.

python -m moshi_mlx infer in.wav -o out.wav [--seed 42] [--voice V --role R] [weight flags]
    [--tokens steps.npz]

Hibiki (`--hf-repo kyutai/hibiki-1b-mlx-bf16`, `--cfg-coef`) translates: French speech in,
English speech (out.wav) and text out. It starts as Kyutai's references do (`lead_in`), and
after the source, as Kyutai's `run_inference`, it gets the end-of-input frame, then silence until
it ends its text (at most `max_tail_frames`); the audio of the steps before the delays fill is
not kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.audio.wav import check_audio_name, read_audio, write_audio
from moshi_mlx.chat.model import StepResult
from moshi_mlx.cli.chat_flags import (
    add_model_args,
    add_persona_args,
    check_persona_args,
    conversation_options,
    load_model,
    print_memory_plan,
    print_voice_names,
)
from moshi_mlx.cli.common import CliParser, invoked_as, log_to_stderr, run_cli
from moshi_mlx.cli.tokens import NO_TOKEN, check_tokens_output, write_tokens
from moshi_mlx.files import check_output, written_atomically
from moshi_mlx.models.config import LmConfig
from moshi_mlx.runtime.codec import SAMPLE_RATE


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = CliParser(
        prog=invoked_as("infer"),
        description="Answer a recorded user turn: in.wav (any rate, any channels) -> out.wav "
        "(Moshi's audio, 24 kHz mono, same length); prints Moshi's text.",
    )
    # Optional only for --list-voices and --memory-plan, which read no audio.
    parser.add_argument("input", nargs="?", help="the user's audio (wav, flac, ogg)")
    parser.add_argument(
        "-o", "--output", help="where to write Moshi's audio (wav, flac, ogg); also: after input"
    )
    parser.add_argument("output_after_input", nargs="?", metavar="output", help=argparse.SUPPRESS)
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument(
        "--tokens",
        metavar="FILE.npz",
        help="also write every step's tokens: text_tokens (T,) Moshi's text, audio_codes "
        "(K, T) Moshi's audio codes (-1 until the delays fill), input_tokens (K_in, T) what "
        "each step fed the LM; T steps, Hibiki's end-of-input and tail steps included",
    )
    add_model_args(parser)
    add_persona_args(parser)
    args = parser.parse_args(argv)
    if args.output is not None and args.output_after_input is not None:
        parser.error("give the output once: -o OUTPUT or after the input, not both")
    args.output = args.output or args.output_after_input
    missing = [
        name for name, value in (("input", args.input), ("-o OUTPUT", args.output)) if not value
    ]
    if missing and not (args.list_voices or args.memory_plan):
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return args


OnStep = Callable[[StepResult], None]


def converse(
    conversation, user_pcm: np.ndarray, frame_size: int, on_step: OnStep | None = None
) -> np.ndarray:
    """Feed `user_pcm` frame by frame (zero-padding the last one); Moshi's audio, same length.
    `on_step` sees every step's result."""
    n_frames = -(-len(user_pcm) // frame_size)
    padded = np.zeros(n_frames * frame_size, dtype=np.float32)
    padded[: len(user_pcm)] = user_pcm
    replies = []
    for i in range(n_frames):
        result = conversation.step(padded[i * frame_size : (i + 1) * frame_size])
        replies.append(result.pcm)
        if on_step is not None:
            on_step(result)
    return np.concatenate(replies)[: len(user_pcm)] if replies else np.zeros(0, np.float32)


def max_tail_frames(source_frames: int) -> int:
    """Frames a translation may run past its source before it is cut: as long as the source,
    at least 10 s (Hibiki lags its source by a few seconds)."""
    return max(source_frames, 125)


def lead_in(config: LmConfig, frame_size: int) -> list[np.ndarray | None]:
    """The frames a translation feeds before its source (None: a step without input), as
    Kyutai's references start: Hibiki-Zero `max_delay` frames of silence (the `hibiki-zero`
    package's `generate`); Hibiki one step without input (`moshi.run_inference` feeds the
    source's first frame twice, and its `LMGen` never reads a first step's input: the model
    hears the same, and the encoder hears that frame once, as there)."""
    if config.model_name == "Hibiki-Zero":
        return [np.zeros(frame_size, np.float32)] * config.max_delay
    return [None]


def translate(
    conversation,
    source_pcm: np.ndarray,
    frame_size: int,
    audio_lag: int,
    on_step: OnStep | None = None,
    lead: Sequence[np.ndarray | None] = (),
) -> np.ndarray:
    """Hibiki: the `lead` frames (`lead_in`), `converse` over the source, then its
    end-of-input frame and silence until the text ends (`max_tail_frames` at most) and the
    `audio_lag` frames of audio behind that text (the LM's `max_delay`) have played; the
    translation's audio, less the first `audio_lag` steps' (the silence a conversation gives
    while the delays fill). An end of text sampled before the end of input is not one
    (Kyutai's rule)."""
    replies = []
    for frame in lead:
        result = conversation.step_without_input() if frame is None else conversation.step(frame)
        replies.append(result.pcm)
        if on_step is not None:
            on_step(result)
    replies.append(converse(conversation, source_pcm, frame_size, on_step))
    silence = np.zeros(frame_size, np.float32)
    result, ended_at = conversation.end_of_input(), None
    for frame in range(max_tail_frames(-(-len(source_pcm) // frame_size))):
        replies.append(result.pcm)
        if on_step is not None:
            on_step(result)
        if ended_at is None and result.end_of_text:
            ended_at = frame
        if ended_at is not None and frame - ended_at >= audio_lag:
            break
        result = conversation.step(silence)
    return np.concatenate(replies)[audio_lag * frame_size :]


def check_audio_output(input_path: Path, output: Path, force: bool) -> None:
    """Raise `MoshiError` unless `output` can be written without touching the user's files
    (`output_files.check_output`) in a format libsndfile writes."""
    check_output(input_path, output, force, what="recording")
    check_audio_name(output)


def step_tokens(steps: Sequence[StepResult], config: LmConfig) -> dict[str, np.ndarray]:
    """The `--tokens` arrays of a conversation's steps (see its help)."""
    silent = np.full(config.moshi_codebooks, NO_TOKEN, np.int32)
    codes = [silent if s.moshi_codes is None else s.moshi_codes for s in steps]
    return {
        "text_tokens": np.array([s.text_token for s in steps], np.int32),
        "audio_codes": np.array(codes, np.int32).reshape(-1, config.moshi_codebooks).T,
        "input_tokens": np.array([s.input_tokens for s in steps], np.int32)
        .reshape(-1, config.num_codebooks)
        .T,
    }


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.memory_plan:
        return print_memory_plan(args)
    if args.list_voices:
        return print_voice_names(args)
    output = Path(args.output)
    check_audio_output(Path(args.input), output, args.force)  # before minutes of inference
    tokens = Path(args.tokens) if args.tokens else None
    if tokens is not None:
        check_tokens_output(tokens, [Path(args.input)], args.force, "recording")
    user_pcm = read_audio(args.input, SAMPLE_RATE)  # before loading: a bad file fails fast
    check_persona_args(args)
    log_to_stderr()  # PersonaPlex: how long its prompt took
    model = load_model(args)

    steps: list[StepResult] = []

    def show(result: StepResult) -> None:
        if tokens is not None:
            steps.append(result)
        if result.text:
            sys.stdout.write(result.text)
            sys.stdout.flush()

    # PersonaPlex: its prompt first (not timed below)
    conversation = model.conversation(**conversation_options(args))
    started = time.monotonic()
    with conversation:
        if model.lm.config.model_type == "hibiki":
            lag, lead = model.lm.config.max_delay, lead_in(model.lm.config, model.frame_size)
            moshi_pcm = translate(conversation, user_pcm, model.frame_size, lag, show, lead)
        else:
            moshi_pcm = converse(conversation, user_pcm, model.frame_size, on_step=show)
        seed = conversation.seed
    elapsed = time.monotonic() - started
    sys.stdout.write("\n")
    with written_atomically(output) as partial:
        write_audio(partial, moshi_pcm, model.sample_rate)
    if tokens is not None:
        write_tokens(tokens, step_tokens(steps, model.lm.config))
    seconds = len(moshi_pcm) / model.sample_rate
    print(
        f"wrote {output}: {seconds:.2f} s of audio in {elapsed:.1f} s "
        f"({seconds / max(elapsed, 1e-9):.2f}x real time), seed {seed}",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx infer`."""
    return run_cli(_run, argv)
