"""The package's layers: every import points down the declared order, never up or sideways.

A module may import its own folder, and any layer below its own. Sibling folders of one layer
(chat, stt, tts) do not import each other. Entry shims (`__main__` and the documented
`python -m moshi_mlx.local`-style modules) sit above everything and nothing imports them.
`testing/` sits above the runtime: nothing in the package imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moshi_mlx

PACKAGE = Path(moshi_mlx.__file__).parent

# Lowest first. Each entry: the top-level names (folders or modules) of one layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("files", "modules", "audio"),
    ("models",),
    ("checkpoints",),
    ("runtime",),
    ("chat", "stt", "tts", "llm"),
    ("assistant",),
    ("api",),
    ("realtime",),
    ("serve",),
    ("cli",),
    ("testing",),
)
ENTRY_SHIMS = {"__main__", "local", "local_web", "run_inference", "quantize"}


def _layer_of(top: str) -> int:
    for level, names in enumerate(LAYERS):
        if top in names:
            return level
    raise AssertionError(f"moshi_mlx.{top} is in no declared layer: add it to LAYERS")


def _module_name(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path) -> list[tuple[str, ...]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moshi_mlx"):
            base = tuple(node.module.split(".")[1:])
            if base:
                found.append(base)
            else:  # from moshi_mlx import x
                found.extend((alias.name,) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(
                tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("moshi_mlx.")
            )
    return found


def _is_shim(name: tuple[str, ...]) -> bool:
    return name[-1] == "__main__" or (len(name) == 1 and name[0] in ENTRY_SHIMS)


def test_every_import_points_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if not name or _is_shim(name):
            continue
        level = _layer_of(name[0])
        for target in _imports(path):
            if _is_shim(target):
                wrong.append(f"{'.'.join(name)} imports the entry shim {'.'.join(target)}")
            elif target[0] != name[0] and _layer_of(target[0]) >= level:
                wrong.append(f"{'.'.join(name)} -> {'.'.join(target)} (not below its layer)")
    assert not wrong, "\n".join(wrong)


def test_entry_shims_are_thin():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name and _is_shim(name):
            code = [line for line in path.read_text().splitlines() if line.strip()]
            assert len(code) <= 10, f"{path.relative_to(PACKAGE)} is more than a shim"


def test_no_module_over_500_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 500
    }
    assert not long, long
