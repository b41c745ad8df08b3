"""Reading checkpoint files and loading them strictly into models.

Every model loads through `load_strict`, so a missing, unexpected or mis-shaped tensor is always
reported the same way: which file, which tensor, expected versus found.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.errors import WeightsError, WeightsMismatchError

_MAX_NAMES_IN_ERROR = 5


def read_safetensors(path: str | Path) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Load a safetensors file lazily; returns its tensors and its metadata."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file not found: {path}")
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mx.load raises plain RuntimeError/ValueError on bad files
        raise WeightsError(f"cannot read {path} as safetensors: {exc}") from exc
    return tensors, dict(metadata or {})


def read_json(path: str | Path) -> dict:
    """Read a JSON file, turning a missing or malformed file into a `WeightsError`."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{path} is not valid JSON: {exc}") from None


def _name_list(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_NAMES_IN_ERROR])
    more = len(names) - _MAX_NAMES_IN_ERROR
    return shown + (f" (and {more} more)" if more > 0 else "")


def check_tensors(
    expected: dict[str, tuple[tuple[int, ...], mx.Dtype | None]],
    found: dict[str, mx.array],
    source: str,
) -> None:
    """Raise `WeightsMismatchError` unless `found` has exactly the expected names and shapes.

    `expected` maps names to (shape, dtype); a dtype of None accepts any floating dtype (the
    model casts on load), while integer dtypes (packed quantized weights) must match exactly.
    """
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    if missing:
        raise WeightsMismatchError(f"{source}: missing tensor(s) {_name_list(missing)}")
    if unexpected:
        raise WeightsMismatchError(f"{source}: unexpected tensor(s) {_name_list(unexpected)}")
    for name, (shape, dtype) in expected.items():
        array = found[name]
        if tuple(array.shape) != tuple(shape):
            raise WeightsMismatchError(
                f"{source}: tensor {name} has shape {tuple(array.shape)}, expected {tuple(shape)}"
            )
        if dtype is not None and array.dtype != dtype:
            raise WeightsMismatchError(
                f"{source}: tensor {name} has dtype {array.dtype}, expected {dtype}"
            )


def load_strict(
    model: nn.Module, tensors: dict[str, mx.array], source: str, dtype: mx.Dtype | None = None
) -> None:
    """Load `tensors` into `model`, requiring exactly the model's parameter names and shapes.

    Floating tensors are cast to `dtype` (default: the parameter's own dtype); packed integer
    tensors of quantized layers must already have the parameter's dtype.
    """
    params = dict(tree_flatten(model.parameters()))
    expected = {
        name: (tuple(p.shape), None if mx.issubdtype(p.dtype, mx.floating) else p.dtype)
        for name, p in params.items()
    }
    check_tensors(expected, tensors, source)
    cast = {}
    for name, array in tensors.items():
        if mx.issubdtype(array.dtype, mx.floating):
            array = array.astype(dtype or params[name].dtype)
        cast[name] = array
    model.update(tree_unflatten(list(cast.items())))
