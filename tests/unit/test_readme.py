"""The README's set-up: two commands in all (install and run, the tests), the first making a
virtual environment (Homebrew's Python refuses a system-wide pip), and the first run's
download stated as the published files' size."""

from __future__ import annotations

import math
import re
from pathlib import Path

from conftest import MANIFESTS

README = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
_BYTES = {"bfloat16": 2, "float32": 4, "uint32": 4}


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def _commands(section: str) -> list[str]:
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def _manifest_gb(name: str) -> float:
    rows = (line.split("\t") for line in (MANIFESTS / name).read_text().splitlines()[1:])
    total = sum(
        math.prod(int(n) for n in shape.split(",")) * _BYTES[dtype] for _, shape, dtype in rows
    )
    return total / 1e9


def test_set_up_is_two_commands_the_first_in_a_virtual_environment():
    set_up = _section("Set up and talk to Moshi").split("\n### ")[0]
    venv = "python3 -m venv .venv && . .venv/bin/activate"
    assert _commands(set_up) == [f"{venv} && pip install -e . && python -m moshi_mlx.local"]
    assert _commands(_section("Run the tests")) == ["./scripts/run_tests.sh"]
    assert "externally-managed-environment" in set_up and "~/.cache/huggingface" in set_up


def test_the_first_download_is_stated_as_the_published_files_size():
    set_up = _section("Set up and talk to Moshi")
    lm, mimi = _manifest_gb("moshiko_mlx_q4.tsv"), _manifest_gb("mimi_checkpoint.tsv")
    assert f"`model.q4.safetensors` ({lm:.1f} GB)" in set_up
    assert f"`tokenizer-e351c8d8-checkpoint125.safetensors` ({mimi:.2f} GB)" in set_up
    total = float(re.search(r"([\d.]+) GB in all", set_up).group(1))
    assert total == round(lm + mimi, 1)
