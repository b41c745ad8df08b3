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
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.errors import WeightsError, WeightsMismatchError

_MAX_NAMES_IN_ERROR = 5
_SAFETENSORS_DTYPES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint32: "U32"}
# bf16 is read as its bits, then viewed as bf16 in MLX.
_NUMPY_DTYPES = {
    mx.bfloat16: np.uint16,
    mx.float16: np.float16,
    mx.float32: np.float32,
    mx.uint32: np.uint32,
}

Layout = dict[str, tuple[tuple[int, ...], mx.Dtype]]  # name -> (shape, dtype)


def layout_of(tensors: dict[str, mx.array]) -> Layout:
    """The names, shapes and dtypes of `tensors` (lazy arrays are not read)."""
    return {name: (tuple(array.shape), array.dtype) for name, array in tensors.items()}


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


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header, read once: its tensors' names, shapes and dtypes, its
    metadata, and where each tensor's bytes lie in the file."""

    path: Path
    layout: Layout
    metadata: dict[str, str]
    spans: dict[str, tuple[int, int]]  # name -> [begin, end) byte offsets in the file


def read_header(path: str | Path) -> SafetensorsHeader:
    """The header of a safetensors file (no tensor data is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        metadata = header.pop("__metadata__", None) or {}
        names = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
        layout = {
            name: (tuple(entry["shape"]), names[entry["dtype"]]) for name, entry in header.items()
        }
        start = 8 + length
        spans = {
            name: (start + entry["data_offsets"][0], start + entry["data_offsets"][1])
            for name, entry in header.items()
        }
    except FileNotFoundError:
        raise WeightsError(f"weights file not found: {path}") from None
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise WeightsError(f"cannot read {path} as safetensors: {exc!r}") from None
    return SafetensorsHeader(path, layout, metadata, spans)


def read_safetensors_header(path: str | Path) -> tuple[Layout, dict[str, str]]:
    """Names, shapes and dtypes of a safetensors file's tensors, and its metadata, from its
    header alone (`read_header`)."""
    header = read_header(path)
    return header.layout, header.metadata


def read_tensors(header: SafetensorsHeader, names: Iterable[str]) -> dict[str, mx.array]:
    """The tensors `names` of the file `header` was read from, each from the bytes the header
    says (the header is not read again; tensors not named are not read at all)."""
    try:
        data = np.memmap(header.path, np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read {header.path}: {exc!r}") from None
    tensors = {}
    for name in names:
        (begin, end), (shape, dtype) = header.spans[name], header.layout[name]
        if end > data.size or end - begin != math.prod(shape) * dtype.size:
            raise WeightsError(
                f"cannot read {header.path} as safetensors: tensor {name}'s data does not fit "
                "the file (an incomplete download?)"
            )
        values = mx.array(data[begin:end].view(_NUMPY_DTYPES[dtype]).reshape(shape))
        tensors[name] = values.view(dtype) if values.dtype != dtype else values
    return tensors


def read_json(path: str | Path) -> dict:
    """Read a JSON file, turning a missing or malformed file into a `WeightsError`."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{path} is not valid JSON: {exc}") from None


def input_major(weight: mx.array) -> mx.array:
    """An (out, in) `nn.Linear` weight whose memory is (in, out): `x @ weight.T` then reads it
    contiguously, which the CPU's reference BLAS does 1.6-2x as fast. Same values, same shape."""
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
