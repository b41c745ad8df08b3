"""The bench's flags: `python scripts/bench.py --help`."""

from __future__ import annotations

import argparse
from pathlib import Path

from moshi_mlx.chat.persona.schedule import SILENCE_FRAMES

from .kyutai import KYUTAI_PYTHON
from .parts import PARTS
from .shapes import DTYPES, LM_SHAPES, QUANT_BITS, TTS_SHAPES

DESCRIPTION = "Speed of moshi_mlx's streaming loop on random weights, optionally beside Kyutai's"
DESCRIPTION += " moshi_mlx."
SUITES = ("gpu",)


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def parser() -> argparse.ArgumentParser:
    """Every flag of the bench, with its default."""
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        type=_csv,
        default=["tiny", "1b"],
        help="tiny,1b,7b,7b-structure,hibiki-zero-3b,hibiki-zero-3b-structure,stt-1b,stt-1b-structure,stt-2.6b,stt-2.6b-structure,stt-tiny; tts part: tts-tiny,tts-small,tts-1.6b,tts-1.6b-structure",
    )
    parser.add_argument("--quant", type=_csv, default=["bf16", "q4"], help="bf16,q8,q4")
    parser.add_argument(
        "--parts",
        type=_csv,
        default=["lm", "mimi", "pipeline", "echo"],
        help="ops,lm,mimi,pipeline,echo,web,kv,kv-fidelity,persona,stt,tts,assistant,realtime "
        "(ops: a step's operations as this backend, CUDA and Metal build it, untimed; stt: "
        "shapes stt-*; assistant: its own tiny models; realtime: its own tiny cascade, Moshi of "
        "the first shape and quant)",
    )
    parser.add_argument(
        "--streams", type=int, default=8, help="stt, tts: streams (requests) in one batch"
    )
    parser.add_argument(
        "--kv-bits", type=_csv, default=["none", "8", "4"], help="KV caches of --parts kv"
    )
    parser.add_argument("--codec", type=_csv, default=["mlx", "rustymimi"], help="mlx,rustymimi")
    parser.add_argument(
        "--turns", type=int, default=3, help="assistant, realtime: user turns answered"
    )
    parser.add_argument("--steps", type=int, default=50, help="measured LM steps per case")
    parser.add_argument("--split-steps", type=int, default=20, help="steps timed part by part")
    parser.add_argument(
        "--dtype", type=_csv, default=["auto"], help="our compute dtype(s): auto,bf16,f32"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="LM runs per case, alternating with Kyutai's"
    )
    parser.add_argument("--frames", type=int, default=20, help="measured Mimi/pipeline frames")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--batch-seconds", type=float, default=10.0, help="batch Mimi encode/decode (0: skip)"
    )
    parser.add_argument(
        "--prompt-steps", type=int, default=300, help="persona: the prompt's steps (runs)"
    )
    parser.add_argument(
        "--prefill-steps", type=int, default=0, help="persona: prompt steps prefilled (0: all)"
    )
    parser.add_argument(
        "--replay-steps", type=int, default=0, help="persona: prompt steps replayed (0: all)"
    )
    parser.add_argument(
        "--persona-rounds", type=int, default=3, help="persona: prefills and cached starts timed"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-dir", type=Path, help="keep/reuse random weights here")
    parser.add_argument("--kyutai", action="store_true", help="also run Kyutai's moshi_mlx")
    parser.add_argument("--kyutai-python", default=KYUTAI_PYTHON)
    parser.add_argument("--json", "-o", type=Path, help="write all results here")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="print where a step's bytes are, per published model and Apple chip, and exit",
    )
    parser.add_argument(
        "--suite",
        choices=SUITES,
        help="gpu: every figure that needs a GPU, each on its own flags (of the others only "
        "--tiny, --seed, --weights-dir, --kyutai, --kyutai-python and --json apply), into one "
        "JSON file",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="--suite on tiny shapes and few steps (tests)"
    )
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags of `argv`, checked: an unknown name in a list flag, or a persona prompt that
    does not fit the shapes' context, exits with a one-line error."""
    flags = parser()
    args = flags.parse_args(argv)
    for name, allowed in (
        ("shapes", {**LM_SHAPES, **TTS_SHAPES}),
        ("quant", QUANT_BITS),
        ("parts", PARTS),
        ("kv_bits", ("none", "8", "4")),
        ("codec", ("mlx", "rustymimi")),
        ("dtype", DTYPES),
    ):
        unknown = set(getattr(args, name)) - set(allowed)
        if unknown:
            flag = "--" + name.replace("_", "-")
            known = ", ".join(allowed)
            _fail(flags, f"{flag}: unknown {', '.join(sorted(unknown))} (known: {known})")
    lm_contexts = [LM_SHAPES[shape]["context"] for shape in args.shapes if shape in LM_SHAPES]
    context = min(lm_contexts, default=LM_SHAPES["tiny"]["context"])
    if not 2 * SILENCE_FRAMES <= args.prompt_steps < context:
        _fail(flags, f"--prompt-steps: from {2 * SILENCE_FRAMES} to {context - 1}")
    if args.persona_rounds < 1 or min(args.prefill_steps, args.replay_steps) < 0:
        _fail(flags, "--persona-rounds must be >= 1, --prefill-steps and --replay-steps >= 0")
    return args


def _fail(flags: argparse.ArgumentParser, message: str) -> None:
    flags.exit(2, f"{flags.prog}: error: {message}\n")
