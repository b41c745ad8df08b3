"""Reading PyTorch `.pt` files (torch.save's zip format) without torch and without running code.

A `.pt` file is a zip holding `<top>/data.pkl`, a pickle of the saved object, and one raw
`<top>/data/<key>` entry per tensor storage. Pickle is a small program; what makes it dangerous
is the callables it reaches. Python's C `pickle.Unpickler` resolves every global (GLOBAL,
STACK_GLOBAL, INST, OBJ, EXT*) through `find_class`, and REDUCE, NEWOBJ and BUILD act only on
objects already on the stack, which come from `find_class`, `persistent_load` or earlier calls.
So: before unpickling, a scan with `pickletools.genops` (which executes nothing) refuses every
opcode but plain data, memo, GLOBAL/STACK_GLOBAL, REDUCE and PERSID ones (no BUILD, INST, OBJ,
NEWOBJ, EXT*, out-of-band buffers) and memo indices far past the memo; `find_class` answers our
own functions for the names torch writes for tensors (`torch._utils._rebuild_tensor_v2`, the
`torch.*Storage` types, `collections.OrderedDict`) and refuses every other name; and the result
is checked to hold only plain containers, scalars and arrays. A tensor's offset, sizes and
strides are checked against its storage before its strided view is copied, and every size a
file declares is capped before anything is read.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import reprlib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from moshi_mlx.errors import WeightsError

MAX_BYTES = 2 << 30  # storages read plus tensors built, per file
MAX_PICKLE_BYTES = 64 << 20

# torch's storage type -> how its bytes are stored (bf16: read as uint16, returned as float32).
_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.uint8,
}

# What torch.save's pickles use (protocol 2), plus plain data opcodes of other protocols.
_OPCODE_NAMES = (
    "PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 "
    "LONG LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE "
    "SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 EMPTY_LIST APPEND APPENDS "
    "LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT DICT SETITEM SETITEMS GET BINGET "
    "LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE GLOBAL STACK_GLOBAL REDUCE PERSID BINPERSID"
)
_OPCODES = frozenset(_OPCODE_NAMES.split())

TorchValue = Any  # np.ndarray, dict, list, tuple, int, float, str, bytes, bool or None, nested


class _StorageType:
    """What `find_class` answers for `torch.<name>Storage`: a name, not a callable."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class _Storage:
    """One storage entry, as a flat native-endian array (bf16 already widened to float32)."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


def read_torch_file(path: str | Path) -> TorchValue:
    """The object `torch.save` wrote to `path`, with tensors as numpy arrays.

    Tensors come back as contiguous numpy arrays of their dtype, except bfloat16, which numpy
    lacks: it comes back as float32 (exact). Dicts (OrderedDict included) come back as dicts;
    lists, tuples, ints, floats, strings, bools and None as themselves. Anything else in the
    file (other classes, functions, code) is refused with a `WeightsError`, as are damaged or
    oversized files; nothing is executed.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise WeightsError(f"file not found: {path}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise WeightsError(f"cannot read {path} as a PyTorch file (not a zip: {exc})") from None
    try:
        with archive:
            return _TorchUnpickler(path, archive).read()
    except WeightsError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise WeightsError(f"cannot read {path} as a PyTorch file: {exc}") from None
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
        raise WeightsError(f"cannot read {path} as a PyTorch file (bad pickle, {detail})") from None


class _TorchUnpickler(pickle.Unpickler):
    def __init__(self, path: Path, archive: zipfile.ZipFile) -> None:
        self.path = path
        self.archive = archive
        pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise self.refuse(f"expected one */data.pkl in the zip, found {len(pickles)}")
        self.top = pickles[0].removesuffix("/data.pkl")
        byteorder = self.entry_bytes("byteorder", optional=True) or b"little"
        if byteorder not in (b"little", b"big"):
            raise self.refuse(f"unknown byte order {byteorder!r}")
        self.big_endian = byteorder == b"big"
        self.budget = MAX_BYTES
        self.storages: dict[str, _Storage] = {}
        self.checked: set[int] = set()
        program = self.entry_bytes("data.pkl", limit=MAX_PICKLE_BYTES)
        self.check_opcodes(program)
        super().__init__(io.BytesIO(program))

    def refuse(self, what: str) -> WeightsError:
        return WeightsError(f"refusing {self.path} as a PyTorch tensor file: {what}")

    def spend(self, nbytes: int, what: str) -> None:
        if nbytes > self.budget:
            raise self.refuse(f"{what} would take the file past {MAX_BYTES >> 30} GiB")
        self.budget -= nbytes

    def entry_bytes(self, name: str, limit: int = 16, optional: bool = False) -> bytes | None:
        try:
            info = self.archive.getinfo(f"{self.top}/{name}")
        except KeyError:
            if optional:
                return None
            raise self.refuse(f"the zip has no {_shown(f'{self.top}/{name}')}") from None
        if info.file_size > limit:
            raise self.refuse(
                f"{_shown(info.filename)} declares {info.file_size} bytes, over {limit}"
            )
        return self.archive.read(info)

    def check_opcodes(self, program: bytes) -> None:
        """Refuse opcodes that build objects (BUILD, INST, OBJ, NEWOBJ...) and memo indices
        far past the memo (the C unpickler allocates up to them)."""
        puts = 0
        for opcode, arg, _ in pickletools.genops(program):
            if opcode.name not in _OPCODES:
                raise self.refuse(f"its pickle uses {opcode.name}, which tensor data never needs")
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                if opcode.name != "MEMOIZE" and arg > puts:
                    raise self.refuse(f"its pickle stores memo entry {arg} of {puts}")
                puts += 1

    def read(self) -> TorchValue:
        result = self.load()
        _check_plain(result, self)
        return result

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return self.rebuild_tensor
        if module == "collections" and name == "OrderedDict":
            return _ordered_dict
        raise self.refuse(
            f"its pickle asks for {_shown(f'{module}.{name}')}, which is not tensor data"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self.refuse(f"unknown persistent record {_shown(pid)}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str):
            raise self.refuse(f"malformed storage record {_shown(pid)}")
        if key not in self.storages:
            dtype = np.dtype(_STORAGE_DTYPES[storage_type.name])
            if type(numel) is not int or numel < 0:
                raise self.refuse(f"storage {_shown(key)} has a bad element count {_shown(numel)}")
            self.spend(numel * dtype.itemsize, f"storage {_shown(key)}")
            data = self.entry_bytes(f"data/{key}", limit=numel * dtype.itemsize)
            if len(data) != numel * dtype.itemsize:
                raise self.refuse(
                    f"storage {_shown(key)} holds {len(data)} bytes, its record says "
                    f"{numel} x {dtype.itemsize}"
                )
            values = np.frombuffer(data, dtype.newbyteorder(">" if self.big_endian else "<"))
            values = values.astype(dtype)  # native byte order, writable
            if storage_type.name == "BFloat16Storage":
                values = (values.astype(np.uint32) << 16).view(np.float32)
            elif storage_type.name == "BoolStorage":
                values = values != 0
            self.storages[key] = _Storage(values)
        return self.storages[key]

    def rebuild_tensor(
        self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any
    ) -> np.ndarray:
        """torch._utils._rebuild_tensor(_v2): a strided view of a storage, copied."""
        if len(rest) not in (0, 2, 3) or not isinstance(storage, _Storage):
            raise self.refuse("a tensor record that is not (storage, offset, size, stride, ...)")
        if len(rest) == 3 and rest[2] and any(rest[2].values()):
            raise self.refuse(
                f"tensor metadata {_shown(rest[2])} (conj/neg views) is not supported"
            )
        shape_ok = isinstance(size, tuple | list) and isinstance(stride, tuple | list)
        if not (shape_ok and len(size) == len(stride) <= 32) or not all(
            type(v) is int and v >= 0 for v in (offset, *size, *stride)
        ):
            raise self.refuse(
                f"a tensor with offset {_shown(offset)}, size {_shown(size)}, stride {_shown(stride)}"
            )
        values = storage.values
        numel = math.prod(size)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if numel else offset - 1
        if last >= len(values):
            raise self.refuse(
                f"a tensor (offset {offset}, size {tuple(size)}, stride {tuple(stride)}) "
                f"reaches past its storage of {len(values)} elements"
            )
        self.spend(numel * values.itemsize, "a tensor")
        strides = tuple(s * values.itemsize for s in stride)
        view = np.lib.stride_tricks.as_strided(values[offset:], tuple(size), strides)
        return view.copy()  # C order, owning its memory


def _ordered_dict(*args: Any) -> dict:
    if args:
        raise pickle.UnpicklingError("OrderedDict with arguments")
    return {}


def _shown(value: object) -> str:
    """A short one-line repr of a value from the file (which may be long, deep or shared)."""
    return reprlib.repr(value)


def _check_plain(value: Any, reader: _TorchUnpickler, path: tuple[int, ...] = ()) -> None:
    """Refuse anything in the result but containers, scalars and arrays, and cycles.

    `reader.checked` holds the containers already seen, so shared ones are walked once."""
    if value is None or isinstance(value, bool | int | float | str | bytes | np.ndarray):
        return
    if not isinstance(value, dict | list | tuple):
        raise reader.refuse(f"it holds a {type(value).__name__}, which is not tensor data")
    if id(value) in path or len(path) > 100:
        raise reader.refuse("its containers hold themselves or nest over 100 deep")
    if id(value) in reader.checked:
        return
    reader.checked.add(id(value))
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    for item in items:
        _check_plain(item, reader, (*path, id(value)))
