"""`--tokens FILE.npz`: every step's tokens of a run, written beside a command's outputs with
the same care (never over an input, over an existing file only with `--force`, atomically)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from moshi_mlx.errors import MoshiError
from moshi_mlx.files import check_output, folder_problem, written_atomically

NO_TOKEN = -1  # a step that wrote no token there (delays not filled, past a stream's end)


def check_tokens_output(output: Path, inputs: Sequence[Path], force: bool, what: str) -> None:
    """`MoshiError` unless the tokens may be written to `output`: a `.npz` name that no input
    `what` holds (`files.check_output`)."""
    if output.suffix != ".npz":
        raise MoshiError(f"cannot write the tokens to {output}: give a .npz file name")
    for input_path in inputs or [Path("-")]:
        check_output(input_path, output, force, what)


def write_tokens(output: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write `arrays` as one npz file, atomically."""
    if problem := folder_problem(output):  # the folder may have gone during the run
        raise MoshiError(f"cannot write {output}: {problem}")
    with written_atomically(output) as partial, partial.open("wb") as file:
        np.savez(file, **arrays)
