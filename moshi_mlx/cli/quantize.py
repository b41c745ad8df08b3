"""Convert or quantize a Moshi LM checkpoint to Kyutai's MLX format.

    python -m moshi_mlx quantize model.safetensors -q 4 [--group-size 64] [-o OUT] [--check]

The conversion lives in `moshi_mlx.checkpoints.quantize`, the `--check` comparison in
`moshi_mlx.chat.check`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from moshi_mlx.chat.check import check_source, compare_generation
from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.checkpoints.spec import GROUP_SIZES, LM_FILES
from moshi_mlx.cli.common import (
    CliParser,
    add_alias,
    invoked_as,
    non_negative_int,
    positive_int,
    run_cli,
)
from moshi_mlx.errors import MoshiError, WeightsMismatchError


def _parser() -> CliParser:
    parser = CliParser(
        prog=invoked_as("quantize"),
        description="Convert a bf16 Moshi LM checkpoint (Kyutai's MLX or PyTorch naming) to "
        "Kyutai's MLX format: 4-bit, 8-bit or bf16.",
    )
    parser.add_argument("input", type=Path, help="bf16 model.safetensors (MLX or PyTorch naming)")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="output file (default: model.q4/q8.safetensors next to input)",
    )
    parser.add_argument(
        "-q",
        "--quantize",
        type=int,
        choices=tuple(LM_FILES),
        default=4,
        help="LM precision: 4 or 8 bits, 16 = bf16 (default %(default)s)",
    )
    add_alias(parser, "--bits", dest="quantize", type=int, choices=tuple(LM_FILES))
    parser.add_argument(
        "--group-size",
        type=int,
        choices=GROUP_SIZES,
        help="default: Kyutai's 32 for 4 bits, 64 for 8 bits (64 makes a smaller q4 file)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        help="show a progress bar on stderr (default: when it is a terminal)",
    )
    parser.add_argument(
        "--worst",
        type=non_negative_int,
        default=5,
        help="how many worst layers to list (default %(default)s)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare greedy generation of the source and the converted model (loads one, then "
        "the other: needs memory for the bf16 model)",
    )
    parser.add_argument(
        "--check-steps",
        type=positive_int,
        default=16,
        help="steps for --check (default %(default)s)",
    )
    parser.add_argument(
        "--lm-config",
        type=Path,
        help="Kyutai config.json of the input (default: config.json next to it, else the "
        "config its layout says: Moshi or PersonaPlex 7B); the output carries it",
    )
    add_alias(parser, "--config", dest="lm_config", type=Path)
    return parser


def _run(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    config = lm_config_of(args.input, args.lm_config)
    if args.check and config.model_type == "tts":
        raise MoshiError(
            "--check replays Moshi-style generation, which a text-to-speech model cannot run "
            "without text and voices; convert without --check (the error report compares the "
            "weights)"
        )
    if args.check:  # a config that does not fit the weights is found before converting
        try:
            check_source(args.input, config)
        except WeightsMismatchError as exc:
            raise WeightsMismatchError(
                f"{exc}; --check needs the config.json of these weights (--lm-config)"
            ) from None
    result = quantize_checkpoint(
        args.input, args.output, args.quantize, args.group_size, args.force, args.progress, config
    )
    print(result.error_report(args.worst))
    print(result.summary())
    if args.check:
        check = compare_generation(args.input, result.output, config, args.check_steps)
        print(check.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m moshi_mlx quantize`; user errors exit 2, Ctrl-C 130 (no
    partial file is left behind)."""
    return run_cli(_run, argv)
