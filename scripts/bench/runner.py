"""A bench run: the chosen parts, in the registry's order, each case printed as it comes."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import mlx.core as mx

from .parts import PARTS
from .tables import case_lines


def run(args: argparse.Namespace, folder: Path) -> list[dict]:
    """Every case of `args.parts` on the weights in `folder` (written there when missing)."""
    results = []
    for part in PARTS.values():
        if part.name not in args.parts:
            continue
        for case in part.cases(args, folder):
            results.append(case)  # kept for the JSON, and printed as it comes
            print(case_lines(case), flush=True)
    return results


def machine() -> dict:
    """What the JSON report says of the machine."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
    }


def json_args(args: argparse.Namespace) -> dict:
    """The flags as the JSON report keeps them (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
