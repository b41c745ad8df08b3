"""Reading checkpoint files, loading them strictly into models, and writing them piecewise.

Every model loads through `load_strict`, so a missing, unexpected or mis-shaped tensor is always
reported the same way: which file, which tensor, expected versus found. `SafetensorsWriter`
writes large files without ever holding a whole tensor set (or tensor) in memory.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.errors import WeightsError, WeightsMismatchError, one_line

_MAX_NAMES_IN_ERROR = 5
_SAFETENSORS_DTYPES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint32: "U32"}

Layout = dict[str, tuple[tuple[int, ...], mx.Dtype]]  # name -> (shape, dtype)


def layout_of(tensors: dict[str, mx.array]) -> Layout:
    """The names, shapes and dtypes of `tensors` (lazy arrays are not read)."""
    return {name: (tuple(array.shape), array.dtype) for name, array in tensors.items()}


def read_safetensors(path: str | Path, parameter: str | None = None) -> SafetensorsFile:
    """A safetensors file opened lazily (`mx.load`): its header is read, no tensor data is
    until a tensor is evaluated; `WeightsError` (about `parameter`, the one that gave the
    path, if any) for a missing file or one that is not safetensors (empty, truncated,
    another format)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file not found: {path}", parameter=parameter)
    try:
        tensors, metadata = mx.load(str(path), format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError) as exc:  # MLX's messages for a bad header or size
        reason = "it is empty" if path.stat().st_size == 0 else one_line(exc).split("] ", 1)[-1]
        raise WeightsError(
            f"{path} is not a safetensors file ({reason})", parameter=parameter
        ) from None
    return SafetensorsFile(path, tensors, dict(metadata or {}))


@dataclass(frozen=True)
class SafetensorsFile:
    """A safetensors file as `read_safetensors` opened it: its tensors (lazy: each is read
    from the file when evaluated, and never when not used) and its metadata."""

    path: Path
    tensors: dict[str, mx.array]
    metadata: dict[str, str]

    @property
    def layout(self) -> Layout:
        """The names, shapes and dtypes of its tensors."""
        return layout_of(self.tensors)


def input_major(weight: mx.array) -> mx.array:
    """The (out, in) `nn.Linear` weight with the same values and shape, its memory laid out
    (in, out): `x @ weight.T` then reads it contiguously, which the CPU's reference BLAS does
    faster (docs/performance.md, "Float32 compute on the CPU")."""
    return mx.contiguous(weight.T).T


def name_list(names: Iterable[str]) -> str:
    """The first few of `names`, sorted, for an error message."""
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
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
        raise WeightsMismatchError(f"{source}: missing tensor(s) {name_list(missing)}")
    if unexpected:
        raise WeightsMismatchError(f"{source}: unexpected tensor(s) {name_list(unexpected)}")
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


def check_fits_model(model: nn.Module, tensors: dict[str, mx.array], source: str) -> None:
    """`check_tensors` against `model`'s parameters: exactly their names and shapes (floating
    tensors of any floating dtype, packed integer ones of the parameter's dtype)."""
    expected = {
        name: (tuple(p.shape), None if mx.issubdtype(p.dtype, mx.floating) else p.dtype)
        for name, p in tree_flatten(model.parameters())
    }
    check_tensors(expected, tensors, source)


def load_strict(
    model: nn.Module, tensors: dict[str, mx.array], source: str, dtype: mx.Dtype | None = None
) -> None:
    """Load `tensors` into `model`, requiring exactly the model's parameter names and shapes.

    Floating tensors are cast to `dtype` (default: the parameter's own dtype); packed integer
    tensors of quantized layers must already have the parameter's dtype.
    """
    check_fits_model(model, tensors, source)
    params = dict(tree_flatten(model.parameters()))
    cast = {}
    for name, array in tensors.items():
        target = dtype or params[name].dtype
        if mx.issubdtype(array.dtype, mx.floating) and array.dtype != target:
            array = array.astype(target)
        cast[name] = array
    model.update(tree_unflatten(list(cast.items())))


class SafetensorsWriter:
    """Writes a safetensors file whose layout is known in advance, tensor pieces at any time.

    The header (names, dtypes, shapes, offsets) is written first; `write_rows` then puts a block
    of rows at its final place, so no tensor ever needs to be whole in memory.
    """

    def __init__(self, file: BinaryIO, layout: Layout, metadata: dict[str, str]):
        header: dict[str, object] = {"__metadata__": metadata}
        self._entries: dict[str, tuple[int, int, tuple[int, ...], mx.Dtype]] = {}
        offset = 0
        for name, (shape, dtype) in layout.items():
            nbytes = math.prod(shape) * dtype.size
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._entries[name] = (offset, nbytes, shape, dtype)
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
        self._file = file
        self._data_start = 8 + len(encoded)
        self.total_bytes = self._data_start + offset
        self._written = dict.fromkeys(layout, 0)
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(self.total_bytes)

    def write_rows(self, name: str, first_row: int, rows: mx.array) -> None:
        """Write `rows` (already evaluated) as rows first_row.. of tensor `name`."""
        offset, nbytes, shape, dtype = self._entries[name]
        assert rows.dtype == dtype and tuple(rows.shape[1:]) == tuple(shape[1:]), name
        data = memoryview(rows)
        if not data.c_contiguous:  # row blocks of whole tensors always are; be safe anyway
            rows = mx.contiguous(rows)
            mx.eval(rows)
            data = memoryview(rows)
        row_bytes = nbytes // shape[0]
        self._file.seek(self._data_start + offset + first_row * row_bytes)
        self._file.write(data)
        self._written[name] += data.nbytes

    def check_complete(self) -> None:
        """Assert that every byte of every tensor was written exactly once."""
        incomplete = [n for n, done in self._written.items() if done != self._entries[n][1]]
        assert not incomplete, f"tensors not fully written: {incomplete[:5]}"
