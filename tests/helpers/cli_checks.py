"""The tests' commands in a subprocess of this interpreter, and what they check of them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def offline_env(root: Path, **extra: str) -> dict[str, str]:
    """This process's environment, offline (hub cache under `root`), with no weights folder
    (`root`/no_weights) and this checkout's package first on PYTHONPATH; `extra` on top."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(root / "hf"),
        MOSHI_MLX_WEIGHTS=str(root / "no_weights"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        **extra,
    )
    return env


def run_python(
    env: Mapping[str, str],
    *args,
    cwd: Path | None = None,
    stdin: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """`python *args` with `env` (its exit code not checked), stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, *map(str, args)],
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one line `error: ...` of a refused command, checked: exit code 2, no traceback,
    nothing else on stderr."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]
