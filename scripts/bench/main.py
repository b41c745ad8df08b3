"""The bench's one entry: `python scripts/bench.py [flags]` (or `python scripts/bench`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .cli import parse_args
from .floor import format_floor
from .runner import json_args, machine, run
from .suite import run_suite
from .tables import final_table

SUITE_FLAGS = ("suite", "tiny")  # not in a plain run's JSON


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the bench with `argv`'s flags; the results (a suite's: its JSON report's figures)."""
    args = parse_args(argv)
    if args.floor:
        print(format_floor())
        return []
    if args.suite is not None:
        return run_suite(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.weights_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = run(args, folder)
    print()
    print(final_table(results))
    if args.json is not None:
        flags = {k: v for k, v in json_args(args).items() if k not in SUITE_FLAGS}
        report = {"machine": machine(), "args": flags, "results": results}
        args.json.write_text(json.dumps(report, indent=2))
    return results
