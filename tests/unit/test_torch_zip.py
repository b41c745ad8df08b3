"""torch_zip reads real torch.save files exactly and refuses hostile or damaged ones.

The real files are fixtures made by scripts/make_torch_zip_fixtures.py (torch is not a test
dependency); the hostile ones are built here from raw pickle opcodes and zipfile.
"""

import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from moshi_mlx.checkpoints import torch_zip
from moshi_mlx.checkpoints.torch_zip import read_torch_file
from moshi_mlx.errors import MoshiError, WeightsError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "torch_zip"


def _flat(value, prefix=""):
    if isinstance(value, np.ndarray):
        return {prefix.rstrip("/"): value}
    if not isinstance(value, dict | list | tuple):
        return {}
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return {k: v for key, item in items for k, v in _flat(item, f"{prefix}{key}/").items()}


@pytest.mark.parametrize("name", ["voice", "dtypes", "views", "nested", "persona_voice"])
def test_reads_torch_files_exactly(name):
    value = read_torch_file(FIXTURES / f"{name}.pt")
    arrays = _flat(value)
    expected = np.load(FIXTURES / f"{name}.npz")
    assert sorted(arrays) == sorted(expected.files)
    for key, array in arrays.items():
        want = expected[key]
        assert (array.dtype, array.shape) == (want.dtype, want.shape), key
        assert array.tobytes() == want.tobytes(), key  # bit for bit: -0.0, inf, subnormals
        assert array.flags.c_contiguous and array.flags.writeable


def test_voice_prompt_layout():
    voice = read_torch_file(FIXTURES / "voice.pt")
    assert voice["embeddings"].dtype == np.float32  # saved as bfloat16
    assert voice["embeddings"].shape == (5, 1, 1, 16)
    assert voice["cache"].dtype == np.int64 and voice["cache"].shape == (1, 17, 4)


def test_plain_values_and_archive_folder():
    nested = read_torch_file(FIXTURES / "nested.pt")  # saved to a file object: "archive/..."
    assert type(nested) is dict and list(nested) == ["a", "b", "c"]
    assert nested["a"] == [1, -2.5, "text", None, True, False, 2**70]
    assert isinstance(nested["b"], tuple) and list(nested["b"][1]) == ["x"]
    assert nested["c"] == {"d": [], "e": ()}


# Hand-written pickles (protocol 2), as torch.save writes them.


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _int(number: int) -> bytes:
    if -(2**31) <= number < 2**31:
        return b"J" + struct.pack("<i", number)
    data = pickle.encode_long(number)
    return b"\x8a" + bytes([len(data)]) + data


def _tuple(numbers) -> bytes:
    return b"(" + b"".join(map(_int, numbers)) + b"t"


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _tensor(storage="FloatStorage", key="0", numel=4, offset=0, size=(4,), stride=(1,)) -> bytes:
    """A pickle of one tensor, without STOP."""
    record = _str("storage") + _global("torch", storage) + _str(key) + _str("cpu") + _int(numel)
    hooks = _global("collections", "OrderedDict") + b")R"
    return (
        b"\x80\x02"
        + _global("torch._utils", "_rebuild_tensor_v2")
        + b"(("
        + record
        + b"tQ"
        + _int(offset)
        + _tuple(size)
        + _tuple(stride)
        + b"\x89"
        + hooks
        + b"tR"
    )


def _write(path: Path, program: bytes, entries=None, top="voice") -> Path:
    entries = {"0": np.arange(4, dtype="<f4").tobytes()} if entries is None else entries
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{top}/data.pkl", program)
        archive.writestr(f"{top}/byteorder", b"little")
        for key, data in entries.items():
            archive.writestr(f"{top}/data/{key}", data)
    return path


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(WeightsError) as caught:
        read_torch_file(path)
    message = str(caught.value)
    assert isinstance(caught.value, MoshiError) and "\n" not in message
    assert str(path) in message
    for word in words:
        assert word in message, message
    return message


def test_hand_written_tensor_reads(tmp_path):
    path = _write(tmp_path / "t.pt", _tensor(size=(2, 2), stride=(1, 2)) + b".")
    np.testing.assert_array_equal(read_torch_file(path), [[0, 2], [1, 3]])


def test_big_endian_storage(tmp_path):
    path = tmp_path / "big.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("big/data.pkl", _tensor() + b".")
        archive.writestr("big/byteorder", b"big")
        archive.writestr("big/data/0", np.arange(4, dtype=">f4").tobytes())
    assert read_torch_file(path).tolist() == [0, 1, 2, 3]


class _Shell:
    def __init__(self, function, argument):
        self.call = (function, (argument,))

    def __reduce__(self):
        return self.call


@pytest.mark.parametrize("function", [os.system, eval, exec])
def test_refuses_code_in_the_pickle(tmp_path, function):
    marker = tmp_path / "pwned"
    command = f"touch {marker}" if function is os.system else f"open({str(marker)!r}, 'w')"
    program = pickle.dumps({"embeddings": _Shell(function, command)}, protocol=2)
    _refused(_write(tmp_path / "evil.pt", program), function.__name__, "not tensor data")
    assert not marker.exists()


def test_refuses_globals_written_by_hand(tmp_path):
    marker = tmp_path / "pwned"
    program = b"\x80\x02" + _global("posix", "system") + _str(f"touch {marker}") + b"\x85R."
    _refused(_write(tmp_path / "evil.pt", program), "posix.system")
    # A global the reader knows, called with the wrong arguments, fails without running code.
    program = b"\x80\x02" + _global("torch", "FloatStorage") + _str("x") + b"\x85R."
    _refused(_write(tmp_path / "call.pt", program), "bad pickle")
    assert not marker.exists()


@pytest.mark.parametrize(
    "program, opcode",
    [
        (b"(S'touch /tmp/pwned_torch_zip'\nios\nsystem\n.", "INST"),  # protocol 0, no find_class
        (_tensor() + b"}b.", "BUILD"),
        (b"\x80\x02" + _global("torch", "FloatStorage") + b")\x81.", "NEWOBJ"),
        (b"\x80\x02\x82\x01.", "EXT1"),
    ],
)
def test_refuses_object_building_opcodes(tmp_path, program, opcode):
    _refused(_write(tmp_path / "evil.pt", program), opcode)
    assert not Path("/tmp/pwned_torch_zip").exists()


def test_shared_and_cyclic_containers(tmp_path):
    # 2**60 paths through 60 shared lists: checked once each, quickly.
    levels = b"".join(
        b"](h" + bytes([i]) + b"h" + bytes([i]) + b"eq" + bytes([i + 1]) for i in range(60)
    )
    program = b"\x80\x02]q\x00" + levels + b"."
    assert len(read_torch_file(_write(tmp_path / "dag.pt", program))) == 2
    program = b"\x80\x02]q\x00h\x00a."  # a list holding itself
    _refused(_write(tmp_path / "cycle.pt", program), "hold themselves")


def test_messages_stay_one_short_line(tmp_path):
    program = b"\x80\x04" + _str("os\nsystem" * 1000) + _str("x\ny") + b"\x93."  # STACK_GLOBAL
    assert len(_refused(_write(tmp_path / "long.pt", program), "asks for")) < 200


def test_refuses_a_huge_memo_index(tmp_path):
    program = b"\x80\x02N" + b"r" + struct.pack("<I", 2**31) + b"."  # LONG_BINPUT 2**31
    _refused(_write(tmp_path / "memo.pt", program), "memo entry")


@pytest.mark.parametrize(
    "tensor, words",
    [
        ({"offset": 1, "size": (4,)}, ["reaches past"]),
        ({"size": (2, 3), "stride": (3, 1)}, ["reaches past"]),
        ({"size": (4,), "stride": (2,)}, ["reaches past"]),
        ({"offset": -1}, ["offset -1"]),
        ({"size": (2**40, 2**40), "stride": (0, 0)}, ["past 2 GiB"]),  # a broadcast bomb
        ({"numel": 2**40}, ["past 2 GiB"]),
        ({"storage": "ComplexFloatStorage"}, ["torch.ComplexFloatStorage"]),
    ],
)
def test_refuses_bad_tensor_records(tmp_path, tensor, words):
    _refused(_write(tmp_path / "bad.pt", _tensor(**tensor) + b"."), *words)


def test_tensor_metadata(tmp_path):
    """_rebuild_tensor_v2's optional metadata: all-false flags are read, a neg view refused."""
    for flag, refused in ((b"\x89", False), (b"\x88", True)):
        program = _tensor()[:-2] + b"}" + _str("neg") + flag + b"stR."
        path = _write(tmp_path / "meta.pt", program)
        if refused:
            _refused(path, "{'neg': True}")
        else:
            assert read_torch_file(path).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "entries, words",
    [
        ({}, ["no 'voice/data/0'"]),
        ({"0": b"\0" * 12}, ["holds 12 bytes", "4 x 4"]),  # truncated storage
        ({"0": b"\0" * 20}, ["declares 20 bytes"]),
    ],
)
def test_refuses_bad_storages(tmp_path, entries, words):
    _refused(_write(tmp_path / "bad.pt", _tensor() + b".", entries), *words)


def test_refuses_what_is_not_a_torch_zip(tmp_path):
    (tmp_path / "text.pt").write_text("hello")
    _refused(tmp_path / "text.pt", "not a zip")
    with zipfile.ZipFile(tmp_path / "empty.pt", "w") as archive:
        archive.writestr("other.txt", b"")
    _refused(tmp_path / "empty.pt", "found 0")
    _refused(_write(tmp_path / "junk.pt", b"junk"), "cannot read")
    _refused(_write(tmp_path / "set.pt", pickle.dumps({1, 2}, protocol=2)), "__builtin__.set")
    with pytest.raises(WeightsError, match="not found"):
        read_torch_file(tmp_path / "missing.pt")


def test_refuses_a_zip_bomb_by_its_declared_size(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_zip, "MAX_PICKLE_BYTES", 1000)
    path = _write(tmp_path / "bomb.pt", _tensor() + b"." + b"\0" * 5000)
    _refused(path, "'voice/data.pkl' declares", "over 1000")
    # The central directory's declared size alone is enough; nothing is decompressed.
    data = bytearray(_write(tmp_path / "patched.pt", _tensor() + b".").read_bytes())
    header = data.index(b"PK\x01\x02")  # data.pkl's central directory record
    data[header + 24 : header + 28] = struct.pack("<I", 0xFFFFFFF0)
    (tmp_path / "patched.pt").write_bytes(bytes(data))
    _refused(tmp_path / "patched.pt", "declares 4294967280 bytes")
