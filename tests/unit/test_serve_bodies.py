"""`moshi_mlx.serve.bodies`: whatever a client sends, parsing ends in `BadBody` (a 4xx or a
protocol error), never in the parser's own exception."""

from __future__ import annotations

import msgpack
import pytest

from moshi_mlx.serve.bodies import BadBody, json_value, text_of, unpack_msgpack


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests too deep"),
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nests too deep"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"text": "\xc3"}', "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        ("\udcff", "not valid JSON"),
    ],
)
def test_json_that_is_malformed_is_a_bad_body(data, reason):
    with pytest.raises(BadBody, match=reason) as caught:
        json_value(data)
    assert caught.value.status == 400


def test_a_multipart_field_that_is_not_utf8_is_a_bad_body():
    assert text_of("héllo".encode()) == "héllo"
    with pytest.raises(BadBody, match="field 'model' is not UTF-8"):
        text_of(b"\xff", "field 'model'")


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 100_000 + b"\x90",  # nested arrays
        b"\xdd" + (1_000).to_bytes(4, "big") + b"\x90" * 1_000,  # many containers
        b"\xc1",  # a byte msgpack never uses
        b"\xa3\xff\xfe\xfd",  # a string that is not UTF-8
        msgpack.packb({"type": "Text"}) + b"\x00",  # extra data
        b"",
    ],
)
def test_msgpack_that_is_malformed_is_a_bad_body(data):
    with pytest.raises(BadBody):
        unpack_msgpack(data, max_containers=4)
