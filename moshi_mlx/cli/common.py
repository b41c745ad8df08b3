"""Command-line plumbing shared by the commands: one parser, the shared flag groups, progress
bars and the error boundary.

Every command speaks one dialect: the same flag means the same thing everywhere (`--hf-repo`,
`--lm-config`, `-o`, the sampling flags), and every bad value ends the command with one line
`error: ...` on stderr and exit code 2, whether argparse or the library finds it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import NoReturn

from tqdm import tqdm

from moshi_mlx.checkpoints.hub import WEIGHTS_ENV
from moshi_mlx.checkpoints.spec import LM_FILES
from moshi_mlx.errors import NO_VALUE, MoshiError, Setting
from moshi_mlx.runtime.codec import BACKENDS, FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.loading import DTYPES, LoadOptions
from moshi_mlx.runtime.sampling import MAX_SEED
from moshi_mlx.serve.limits import Limits

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130


def package_version() -> str:
    """The installed moshi_mlx's version ("unknown" in a checkout that was not installed)."""
    try:
        return metadata.version("moshi_mlx")
    except metadata.PackageNotFoundError:
        return "unknown"


class CliParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose refusals (an unknown flag, a bad value, a missing
    argument, `parser.error(...)`) are one line `error: ...` on stderr and exit code 2, as
    every other user error of the commands; `-h` shows the usage, `--version` the version."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action="version", version=f"moshi_mlx {package_version()}")

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def bounded(kind: type, low: float, high: float = math.inf, *, above: bool = False):
    """An argparse `type`: a finite `kind` (int or float) from `low` (excluded if `above`) to
    `high`, else argparse's one-line refusal (`argument --top-k: must be >= 0, got -5`)."""

    def shown(bound: float) -> str:
        return str(int(bound)) if kind is int else f"{bound:g}"

    if above:
        span = f"> {shown(low)}" + (f" and <= {shown(high)}" if high < math.inf else "")
    else:
        span = f"from {shown(low)} to {shown(high)}" if high < math.inf else f">= {shown(low)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not (math.isfinite(value) and low <= value <= high) or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


port = bounded(int, 1, 65535)
seed = bounded(int, 0, MAX_SEED)
positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
positive_float = bounded(float, 0, above=True)
non_negative_float = bounded(float, 0)


def invoked_as(command: str) -> str:
    """`command` as the user typed it, for `usage:` lines: `moshi-mlx stt` from the installed
    script, `python -m moshi_mlx.local` from that module, else `python -m moshi_mlx stt`."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    if script.startswith("moshi-mlx"):
        return f"moshi-mlx {command}"
    if script == "local.py":
        return "python -m moshi_mlx.local"
    return f"python -m moshi_mlx {command}"


def add_alias(
    group: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, dest: str, **kwargs
) -> None:
    """An old spelling of the flag stored in `dest`: accepted, not shown in `--help`."""
    group.add_argument(
        *names, dest=dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs
    )


def add_weight_args(
    parser: argparse.ArgumentParser,
    default_repo: str,
    *,
    precision: bool = False,
    codec: bool = True,
) -> None:
    """`--hf-repo`, the local file flags (`--moshi-weight`, `--mimi-weight`, `--tokenizer`,
    `--lm-config`), with `precision` `-q/--quantize` and with `codec` `--codec`."""
    weights = parser.add_argument_group(
        "weights",
        f"files are looked up in this order: the path flags, the weights folder "
        f"(${WEIGHTS_ENV}, else ./weights), the Hugging Face hub (and its cache)",
    )
    weights.add_argument(
        "--hf-repo",
        metavar="REPO",
        help=f"Hugging Face repo id, or a local folder laid out like one (default {default_repo})",
    )
    if precision:
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
    if codec:
        weights.add_argument(
            "--codec",
            choices=BACKENDS,
            default=BACKENDS[0],
            help="Mimi backend: mlx, or rustymimi (Rust, on the CPU; default %(default)s)",
        )
    add_dtype_arg(weights)


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's published sampling defaults, and why they are what they are; a None value
    means the model samples no such token, and its command has no such flag."""

    why: str
    temp: float | None = None
    temp_of: str = "audio"  # the tokens `temp` samples
    top_k: int | None = None  # audio top-k
    text_temp: float | None = None
    text_top_k: int | None = None
    seed: bool = True  # whether sampling draws random numbers (not when it is greedy only)


def add_sampling_args(parser: argparse.ArgumentParser, defaults: SamplingDefaults) -> None:
    """`--temp`, `--top-k`, `--text-temp`, `--text-top-k` and `--seed`, those the model
    samples, each with the model's published default."""
    group = parser.add_argument_group("sampling", f"defaults: {defaults.why}")
    if defaults.seed:
        group.add_argument("--seed", type=seed, help="random seed (default: a fresh one each run)")
    flags = (
        ("--temp", "temp", non_negative_float, f"{defaults.temp_of} temperature, 0 = greedy"),
        ("--top-k", "top_k", non_negative_int, "audio top-k, 0 = all tokens"),
        ("--text-temp", "text_temp", non_negative_float, "text temperature, 0 = greedy"),
        ("--text-top-k", "text_top_k", non_negative_int, "text top-k, 0 = all tokens"),
    )
    for flag, name, kind, help_ in flags:
        default = getattr(defaults, name)
        if default is not None:
            group.add_argument(
                flag, type=kind, default=default, help=f"{help_} (default %(default)s)"
            )


def add_dtype_arg(group: argparse._ArgumentGroup) -> None:
    """`--dtype`: the LM's compute dtype (default: bfloat16 on a GPU, float32 on the CPU)."""
    group.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="the LM's compute dtype (default: bfloat16 on a GPU, float32 on the CPU)",
    )


def add_max_lag_arg(group: argparse._ArgumentGroup) -> None:
    """`--max-lag`: how far a live conversation may fall behind the user's audio."""
    group.add_argument(
        "--max-lag",
        type=positive_float,
        default=0.24,
        metavar="SECONDS",
        help="seconds of mic audio the model may fall behind before the oldest is dropped "
        "(default %(default)s)",
    )


def max_lag_frames(args: argparse.Namespace) -> int:
    """`--max-lag` in 80 ms frames (at least one)."""
    return max(1, round(args.max_lag * SAMPLE_RATE / FRAME_SIZE))


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    """`--max-connections`, `--header-timeout`, `--idle-timeout`, `--client-silence-timeout`."""
    defaults = Limits()
    group.add_argument(
        "--max-connections",
        type=positive_int,
        default=defaults.max_connections,
        metavar="N",
        help="open connections at most; the longest-idle one is closed to make room "
        "(default %(default)s, fewer if the descriptor limit, ulimit -n, is lower)",
    )
    group.add_argument(
        "--header-timeout",
        type=positive_float,
        default=defaults.header_timeout,
        metavar="SECONDS",
        help="a new connection's request must arrive within this (default %(default)s)",
    )
    group.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=defaults.idle_timeout,
        metavar="SECONDS",
        help="close keep-alive connections idle this long (default %(default)s)",
    )
    group.add_argument(
        "--client-silence-timeout",
        type=positive_float,
        default=defaults.client_silence_timeout,
        metavar="SECONDS",
        help="end a conversation whose client sent no audio for this long (default "
        "%(default)s); a silent websocket is pinged after half of it",
    )


def limits_from_args(args: argparse.Namespace) -> Limits:
    """The `Limits` of the flags."""
    return Limits(
        max_connections=args.max_connections,
        header_timeout=args.header_timeout,
        idle_timeout=args.idle_timeout,
        client_silence_timeout=args.client_silence_timeout,
    )


def file_options(args: argparse.Namespace) -> dict[str, object]:
    """The flags that name a model's files, codec and compute dtype, as load options by name
    (`moshi_mlx.runtime.loading.LoadOptions`' fields)."""
    return {
        "moshi_weight": args.moshi_weight,
        "mimi_weight": args.mimi_weight,
        "tokenizer": args.tokenizer,
        "lm_config": args.lm_config,
        "codec_backend": args.codec,
        "dtype": args.dtype,
    }


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The weight and memory flags as the options of the one load path."""
    return LoadOptions(
        quantize=args.quantize,
        **file_options(args),
        context=args.context,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )


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


def exit_at_once(code: int) -> NoReturn:
    """End the process now with `code`, after flushing stdout and stderr: for apps whose MLX
    thread may still be inside a step, which tearing MLX down under would abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# The flag of each API parameter a library error may name (`errors.Setting`), and the
# switches whose value the flag says (`force=True` is `--force`).
_FLAGS = {
    "hf_repo": "--hf-repo",
    "quantize": "-q",
    "bits": "-q",
    "group_size": "--group-size",
    "moshi_weight": "--moshi-weight",
    "mimi_weight": "--mimi-weight",
    "tokenizer": "--tokenizer",
    "lm_config": "--lm-config",
    "context": "--context",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "memory_plan": "--memory-plan",
    "voice": "--voice",
    "role": "--role",
    "input_device": "--input-device",
    "output_device": "--output-device",
    "format_devices()": "--list-devices",
}
_SWITCHES = {("force", True): "--force", ("cancel_echo", False): "--no-echo-cancel"}


def as_flag(setting: Setting) -> str:
    """An API parameter that a library error names, as a command line spells it: its flag
    and the value (`kv_bits=3` -> `--kv-bits 3`); its API spelling when no flag sets it."""
    switch = _SWITCHES.get((setting.name, setting.value))
    if switch is not None:
        return switch
    flag = _FLAGS.get(setting.name)
    if flag is None:
        return setting.in_api_terms()
    return flag if setting.value is NO_VALUE else f"{flag} {setting.value}"


@contextmanager
def progress_bar(force: bool | None = None, **kwargs) -> Iterator[tqdm]:
    """A tqdm bar on stderr, shown when stderr is a terminal (or `force`d on or off); an error
    inside wipes it, so that the error's one line stands alone."""
    bar = tqdm(file=sys.stderr, disable=None if force is None else not force, **kwargs)
    try:
        yield bar
    except BaseException:
        bar.leave = False
        raise
    finally:
        bar.close()


def run_cli(command: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """Run `command`, printing a `MoshiError` as one line on stderr, in flag terms (exit code
    2); Ctrl-C prints `interrupted` (exit code 130)."""
    try:
        return command(argv)
    except MoshiError as exc:
        print(f"error: {exc.spelled(as_flag)}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
