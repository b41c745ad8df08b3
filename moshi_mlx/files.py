"""Files written for the user (`run_inference`'s reply, `quantize`'s checkpoint): never over
the input, over an existing file only when asked, and never left half-written."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moshi_mlx.errors import MoshiError, Setting


def check_output(input_path: Path, output: Path, force: bool, what: str) -> None:
    """`MoshiError` unless `output` may be written: a file name (not a folder), not the input
    `what` (by path or inode: hard links too), an existing file only with `force`, in a
    folder that exists and is writable."""
    if output.is_dir():
        raise MoshiError(f"the output {output} is a folder; give a file name")
    if output.exists():
        if input_path.exists() and os.path.samefile(input_path, output):
            raise MoshiError(
                f"the output {output} is the input {what}; it would overwrite the input"
            )
        if not force:
            raise MoshiError(
                f"{output} already exists; pass ", Setting("force", True), " to overwrite it"
            )
    if problem := folder_problem(output):
        raise MoshiError(f"cannot write {output}: {problem}")


def folder_problem(path: Path) -> str | None:
    """Why no file can be created at `path` in its folder (missing, or not writable), or
    None."""
    folder = path.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return f"folder {folder} does not exist or is not writable"
    return None


@contextmanager
def written_atomically(output: Path) -> Iterator[Path]:
    """A temporary path beside `output` (same suffix) for the caller to write: renamed to
    `output` when the block ends, deleted if it raises (Ctrl-C included). Temporary files
    that killed runs left for the same output are deleted first."""
    _remove_stale_partials(output)
    partial = output.with_name(f".{output.name}.{os.getpid()}.partial{output.suffix}")
    try:
        yield partial
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)


def _remove_stale_partials(output: Path) -> None:
    prefix, suffix = f".{output.name}.", f".partial{output.suffix}"
    for partial in output.parent.glob(f"{prefix}*{suffix}"):
        pid = partial.name.removeprefix(prefix).removesuffix(suffix)
        try:
            os.kill(int(pid), 0)  # still running: leave its file alone
        except (ValueError, ProcessLookupError):
            partial.unlink(missing_ok=True)
        except PermissionError:
            pass
