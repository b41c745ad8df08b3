"""Kyutai's speech-to-text messages: what clients may send, what the server sends."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from moshi_mlx.serve.stt import protocol
from moshi_mlx.serve.stt.protocol import Audio, Init, Marker, ProtocolError


def test_client_messages_as_kyutais_clients_pack_them():
    packed = msgpack.packb({"type": "Audio", "pcm": [0.5, -1, 0.25]}, use_single_float=True)
    message = protocol.parse(packed)
    assert isinstance(message, Audio) and message.pcm.dtype == np.float32
    np.testing.assert_array_equal(message.pcm, [0.5, -1.0, 0.25])
    assert protocol.parse(msgpack.packb({"type": "Marker", "id": -7})) == Marker(-7)
    assert protocol.parse(msgpack.packb({"type": "Init"})) == Init()
    extra = msgpack.packb({"type": "Marker", "id": 1, "note": "ignored, as serde does"})
    assert protocol.parse(extra) == Marker(1)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ([1, 2], 'a msgpack map with a string "type"'),
        ({"type": 3}, 'a msgpack map with a string "type"'),
        ({"type": "Audio", "pcm": [True]}, "only numbers"),
        ({"type": "Audio", "pcm": [[0.1]]}, "only numbers"),
        ({"type": "Audio", "pcm": b"\x00\x00"}, 'Audio needs "pcm"'),
        ({"type": "Audio", "pcm": [float("inf")]}, "NaN or infinity"),
        ({"type": "Marker", "id": 2**63}, "64-bit integer"),
        ({"type": "Marker", "id": True}, "64-bit integer"),
        ({"type": "Marker"}, "64-bit integer"),
        ({"type": "x" * 100}, "unknown message type 'xxxx"),
    ],
)
def test_bad_client_messages_are_named(message, reason):
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(")) as caught:
        protocol.parse(msgpack.packb(message))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 120


def test_server_messages_are_kyutais_maps():
    unpack = msgpack.unpackb
    assert unpack(protocol.ready()) == {"type": "Ready"}
    assert unpack(protocol.word("hello", 1.5)) == {
        "type": "Word",
        "text": "hello",
        "start_time": 1.5,
    }
    assert unpack(protocol.end_word(2.0)) == {"type": "EndWord", "stop_time": 2.0}
    assert unpack(protocol.step(3, (0.25, 0.5), 100)) == {
        "type": "Step",
        "step_idx": 3,
        "prs": [0.25, 0.5],
        "buffered_pcm": 100,
    }
    assert unpack(protocol.marker(9)) == {"type": "Marker", "id": 9}
    assert unpack(protocol.error("busy")) == {"type": "Error", "message": "busy"}
