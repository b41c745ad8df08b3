"""Kyutai's moshi_mlx 0.3.0 on the same files (`--kyutai`): `bench_kyutai.py` in its own
environment."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent
KYUTAI_PYTHON = "/opt/venvs/kyutai/bin/python"


def run_kyutai(python: str, part: str, weights: Path, extra: list[str]) -> dict:
    """Run `bench_kyutai.py` in Kyutai's environment; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [python, str(SCRIPTS / "bench_kyutai.py"), part, "--weights", str(weights)]
        command += [*extra, "--json", str(out)]
        # Kyutai's environment must import its own moshi_mlx, never a PYTHONPATH'd one of ours.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=tmp, env=env)
        return json.loads(out.read_text())
