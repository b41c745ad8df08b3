"""The chat protocol's framing and query parameters, the origin rule, and the command's
checks of its flags: no model involved."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from web_harness import free_port

from moshi_mlx.chat.generate import AUDIO_SAMPLING, TEXT_SAMPLING
from moshi_mlx.cli.serve import server_url
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.serve.chat import protocol
from moshi_mlx.serve.chat.protocol import Kind, ProtocolError, session_params
from moshi_mlx.serve.http import is_loopback, origin_allowed


def test_messages_start_with_their_kind():
    assert protocol.handshake() == b"\x00" + bytes(8)
    assert protocol.audio(b"OggS...") == b"\x01OggS..."
    assert protocol.text(" héllo") == b"\x02" + " héllo".encode()
    assert protocol.metadata({"seed": 1}) == b'\x04{"seed": 1}'
    assert protocol.error("busy") == b"\x05busy"
    assert protocol.ping() == b"\x06"
    assert protocol.parse(b"\x01abc") == (Kind.AUDIO, b"abc")
    assert protocol.parse(b"\x03\x00") == (Kind.CONTROL, b"\x00")


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"", "empty message"),
        (b"\x07", "unknown message kind 0x07"),
        (b"\xff\x00", "unknown message kind 0xff"),
        (b"\x01" + bytes(protocol.MAX_MESSAGE_BYTES), "over the limit"),
    ],
)
def test_invalid_messages(message, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.parse(message)


def test_query_parameters_map_onto_sampling_and_one_seed():
    defaults = TEXT_SAMPLING, AUDIO_SAMPLING
    assert session_params({}, defaults, None) == protocol.SessionParams(defaults, None)
    assert session_params({}, defaults, 5).seed == 5  # the server's --seed
    # What Kyutai's web client sends: all of them, with two random seeds.
    query = {
        "text_temperature": "0.5",
        "text_topk": "10",
        "audio_temperature": "0.6",
        "audio_topk": "100",
        "pad_mult": "0",
        "text_seed": "123",
        "audio_seed": "456",
        "repetition_penalty_context": "64",
        "repetition_penalty": "1",
    }
    params = session_params(query, defaults, 5)
    assert params.sampling == (Sampling(0.5, 10), Sampling(0.6, 100))
    assert params.seed == 123  # text_seed, else audio_seed, else --seed
    assert session_params({"audio_seed": "456"}, defaults, 5).seed == 456
    assert session_params({"text_topk": "25.0"}, defaults, None).sampling[0].top_k == 25


@pytest.mark.parametrize(
    "query",
    [
        {"text_temperature": "hot"},
        {"audio_temperature": "-1"},
        {"text_temperature": "nan"},
        {"text_topk": "2.5"},
        {"audio_topk": "-1"},
        {"text_seed": "x"},
        {"audio_seed": str(2**64)},
    ],
)
def test_bad_query_parameters(query):
    with pytest.raises(ProtocolError, match=f"query parameter {next(iter(query))}"):
        session_params(query, (TEXT_SAMPLING, AUDIO_SAMPLING), None)


@pytest.mark.parametrize(
    ("origin", "host", "allowed"),
    [
        (None, "localhost:8998", True),
        ("http://localhost:8998", "localhost:8998", True),
        ("https://Mac.local", "mac.local:443", True),
        ("http://localhost", "localhost:80", True),
        ("http://localhost:8998", "127.0.0.1:8998", False),
        ("http://evil.example:8998", "localhost:8998", False),
        ("http://localhost:9000", "localhost:8998", False),
        ("null", "localhost:8998", False),
        ("file://", "localhost:8998", False),
    ],
)
def test_origin_must_match_host(origin, host, allowed):
    assert origin_allowed(origin, host) is allowed


def test_loopback_hosts():
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    assert not is_loopback("mac.local")


def test_server_urls_bracket_ipv6_hosts():
    assert server_url("localhost", 8998, secure=False) == "http://localhost:8998"
    assert server_url("::1", 8998, secure=False) == "http://[::1]:8998"
    assert server_url("192.168.1.20", 443, secure=True) == "https://192.168.1.20:443"


def _local_web(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "moshi_mlx", "web", "--no-browser", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ssl", "{tmp}"], "cert.pem not found"),
        (["--static", "{tmp}"], "no index.html in that folder"),
        (["--max-lag", "0"], "--max-lag: must be > 0"),
        (["--max-conversations", "0"], "--max-conversations: must be >= 1"),
        (["--max-connections", "0"], "--max-connections: must be >= 1"),
        (["--header-timeout", "0"], "--header-timeout: must be > 0, got 0"),
        (["--idle-timeout", "-1"], "--idle-timeout: must be > 0, got -1"),
        (["--client-silence-timeout", "nan"], "--client-silence-timeout: must be > 0, got nan"),
        (["--role", "@{tmp}/role.txt"], "role file not found"),
        (["--voice", "{tmp}/voice.wav"], "voice file not found"),
    ],
)
def test_bad_flags_are_one_line_errors(tmp_path, flags, message):
    done = _local_web(*(f.format(tmp=tmp_path) for f in flags))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_open_host_without_https_warns_then_missing_weights_stop_it(tmp_path):
    missing = [
        "--moshi-weight",
        str(tmp_path / "m.safetensors"),
        "--mimi-weight",
        str(tmp_path / "mimi.safetensors"),
        "--tokenizer",
        str(tmp_path / "t.model"),
        "--lm-config",
        str(tmp_path / "c.json"),
    ]
    done = _local_web("--host", "0.0.0.0", "--port", str(free_port()), *missing)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "browsers on other machines will refuse the microphone" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ")


def test_port_in_use_is_a_one_line_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _local_web("--host", "127.0.0.1", "--port", str(taken.getsockname()[1]))
    assert done.returncode == 2 and "cannot listen on 127.0.0.1" in done.stderr, done.stderr
