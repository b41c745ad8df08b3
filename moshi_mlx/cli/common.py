"""Command-line plumbing shared by the entry points: model flags and the error boundary."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from moshi_mlx.chat.persona.role import DEFAULT_ROLE, read_role
from moshi_mlx.chat.persona.voice import (
    DEFAULT_VOICE,
    MAX_VOICE_SECONDS,
    existing_voice_file,
    is_voice_name,
)
from moshi_mlx.checkpoints.hub import WEIGHTS_ENV
from moshi_mlx.checkpoints.spec import DEFAULT_REPO, LM_FILES
from moshi_mlx.errors import ConfigError, MoshiError
from moshi_mlx.modules.kv_quant import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES
from moshi_mlx.runtime.codec import BACKENDS, FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.loading import DTYPES, LoadOptions, find_model, load_parts
from moshi_mlx.runtime.sampling import SamplingConfig

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags choosing the weights, the codec backend and sampling."""
    weights = parser.add_argument_group(
        "weights",
        f"files are looked up in this order: the path flags, the weights folder "
        f"(${WEIGHTS_ENV}, else ./weights), the Hugging Face hub (and its cache)",
    )
    weights.add_argument(
        "--hf-repo",
        metavar="REPO",
        help=f"Hugging Face repo id, or a local folder laid out like one (default {DEFAULT_REPO})",
    )
    weights.add_argument(
        "-q",
        "--quantize",
        type=int,
        choices=tuple(LM_FILES),
        help="LM precision: 4 or 8 bits, 16 = bf16 (picks the matching kyutai repo)",
    )
    weights.add_argument("--moshi-weight", metavar="PATH", help="local LM weights (.safetensors)")
    weights.add_argument(
        "--mimi-weight", metavar="PATH", help="local Mimi codec weights (.safetensors)"
    )
    weights.add_argument(
        "--tokenizer", metavar="PATH", help="local text tokenizer (SentencePiece .model)"
    )
    weights.add_argument(
        "--lm-config", metavar="PATH", help="local LM config.json in Kyutai's format"
    )
    weights.add_argument(
        "--codec",
        choices=BACKENDS,
        default=BACKENDS[0],
        help="Mimi backend: mlx, or rustymimi (Rust, on the CPU)",
    )
    add_dtype_arg(weights)
    memory = parser.add_argument_group("memory")
    memory.add_argument(
        "--context",
        type=int,
        metavar="STEPS",
        help="attention window in 80 ms steps, at most the model's 3000 (a shorter one saves "
        "KV-cache memory)",
    )
    memory.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        help="store the KV cache in 8 or 4 bits (about 1/2 or 1/3 of its bf16 size)",
    )
    memory.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        help="values per scale of the quantized KV cache (default "
        + ", ".join(f"{size} for {bits} bits" for bits, size in DEFAULT_KV_GROUP_SIZE.items())
        + ")",
    )
    memory.add_argument(
        "--memory-plan",
        action="store_true",
        help="print how much memory the model would take and whether it fits, then exit",
    )
    defaults = SamplingConfig()
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--seed", type=int, help="random seed (default: a fresh one each run)")
    sampling.add_argument(
        "--temp",
        type=float,
        default=defaults.audio_temp,
        help="audio temperature, 0 = greedy (default %(default)s)",
    )
    sampling.add_argument(
        "--text-temp",
        type=float,
        default=defaults.text_temp,
        help="text temperature, 0 = greedy (default %(default)s)",
    )
    sampling.add_argument(
        "--top-k", type=int, default=defaults.audio_top_k, help="audio top-k (default %(default)s)"
    )
    sampling.add_argument(
        "--text-top-k",
        type=int,
        default=defaults.text_top_k,
        help="text top-k (default %(default)s)",
    )
    sampling.add_argument(
        "--cfg-coef",
        type=float,
        help="Hibiki: classifier-free guidance, 1 = none (default: the model's config, else 1)",
    )


def add_dtype_arg(group: argparse._ArgumentGroup) -> None:
    """`--dtype`: the LM's compute dtype (default: bfloat16 on a GPU, float32 on the CPU)."""
    group.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="the LM's compute dtype (default: bfloat16 on a GPU, float32 on the CPU)",
    )


def add_persona_args(parser: argparse.ArgumentParser) -> None:
    """`--voice`, `--role` and `--list-voices`: PersonaPlex's persona (Moshi takes none)."""
    persona = parser.add_argument_group(
        "persona", "PersonaPlex only: who Moshi is (its prompt is computed once, then cached)"
    )
    persona.add_argument(
        "--voice",
        metavar="NAME|FILE",
        help=f"a published voice's name (default {DEFAULT_VOICE}; see --list-voices), a "
        f"recording of up to {MAX_VOICE_SECONDS:.0f} s (.wav, .flac, ...) or NVIDIA's voice .pt",
    )
    persona.add_argument(
        "--role",
        metavar="TEXT|@FILE",
        help=f"the role, as text or @file.txt to read a file (default: {DEFAULT_ROLE!r})",
    )
    persona.add_argument(
        "--list-voices", action="store_true", help="print the published voices' names and exit"
    )


def check_persona_args(args: argparse.Namespace) -> None:
    """Before the model loads: `ConfigError` for a role file or voice file that is not there."""
    if args.role is not None:
        read_role(args.role)
    if args.voice is not None and not is_voice_name(args.voice):
        existing_voice_file(args.voice)


def add_max_lag_arg(group: argparse._ArgumentGroup) -> None:
    """`--max-lag`: how far a live conversation may fall behind the user's audio."""
    group.add_argument(
        "--max-lag",
        type=float,
        default=0.24,
        metavar="SECONDS",
        help="seconds of mic audio the model may fall behind before the oldest is dropped "
        "(default %(default)s)",
    )


def max_lag_frames(args: argparse.Namespace) -> int:
    """`--max-lag` in 80 ms frames (at least one); `ConfigError` unless it is positive."""
    if args.max_lag <= 0:
        raise ConfigError(f"--max-lag must be > 0 seconds, got {args.max_lag}")
    return max(1, round(args.max_lag * SAMPLE_RATE / FRAME_SIZE))


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    """The `SamplingConfig` that the sampling flags describe."""
    return SamplingConfig(
        text_temp=args.text_temp,
        text_top_k=args.text_top_k,
        audio_temp=args.temp,
        audio_top_k=args.top_k,
    )


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The weight and memory flags as the options of the one load path."""
    return LoadOptions(
        quantize=args.quantize,
        moshi_weight=args.moshi_weight,
        mimi_weight=args.mimi_weight,
        tokenizer=args.tokenizer,
        lm_config=args.lm_config,
        codec_backend=args.codec,
        dtype=args.dtype,
        context=args.context,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )


def print_memory_plan(args: argparse.Namespace) -> int:
    """`--memory-plan`: print the plan of the model the flags describe (no weight is read)."""
    options = load_options(args)
    print(find_model(args.hf_repo, options, "chat").memory.table())
    return 0


def print_voice_names(args: argparse.Namespace) -> int:
    """`--list-voices`: the published voices of the PersonaPlex model the flags describe, one
    name a line (no weight is read)."""
    from moshi_mlx.chat.persona.voice import voice_names
    from moshi_mlx.checkpoints.hub import resolve_voices

    found = find_model(args.hf_repo, load_options(args), "chat")
    if not found.config.prompted:
        raise ConfigError(
            "--list-voices lists PersonaPlex's voices; this model is Moshi, whose voice is in "
            "its weights (load nvidia/personaplex-7b-v1)"
        )
    print("\n".join(voice_names(resolve_voices(found.files))))
    return 0


def log_to_stderr() -> None:
    """Show the package's log messages (how long a prompt took, checkpoint notices) on
    stderr as `[name] message`."""
    logger = logging.getLogger("moshi_mlx")
    if not any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class _StderrHandler(logging.Handler):
    """Writes to the `sys.stderr` of the moment (tests and apps may replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging must never break the app
            self.handleError(record)


def load_model(args: argparse.Namespace):
    """Load the chat model (`MoshiModel`) that the weight flags describe."""
    from moshi_mlx.chat.model import MoshiModel

    return MoshiModel.from_parts(load_parts(args.hf_repo, load_options(args), "chat"), args.codec)


def exit_at_once(code: int) -> NoReturn:
    """End the process now with `code`, after flushing stdout and stderr: for apps whose MLX
    thread may still be inside a step, which tearing MLX down under would abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(command: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """Run `command`, printing a `MoshiError` as one line on stderr (exit code 2)."""
    try:
        return command(argv)
    except MoshiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
