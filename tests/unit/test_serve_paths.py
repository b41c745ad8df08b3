"""No path of the server's disk goes to a client: model ids of local folders are their base
names, and messages to clients have file paths cut to their last name."""

from __future__ import annotations

import logging

import pytest

from moshi_mlx.serve.chat import protocol as chat_protocol
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.logtext import without_paths
from moshi_mlx.serve.openai.errors import ApiError


@pytest.mark.parametrize(
    ("message", "told"),
    [
        ("cannot read /Users/me/models/x.safetensors: bad", "cannot read .../x.safetensors: bad"),
        ("no voice in /home/u/.cache/huggingface/hub/v.", "no voice in .../v."),
        ("folder ~/weights/stt/ is empty", "folder .../stt is empty"),
        ("(/opt/models/llm)", "(.../llm)"),
        ("see GET /v1/audio/voices", "see GET /v1/audio/voices"),
        ("ws://127.0.0.1:8090/api/tts_streaming", "ws://127.0.0.1:8090/api/tts_streaming"),
        ("huggingface.co/kyutai/tts-voices", "huggingface.co/kyutai/tts-voices"),
    ],
)
def test_messages_to_clients_name_no_folder(message, told):
    assert without_paths(message) == told


def test_openai_errors_name_no_folder():
    error = ApiError(500, "the speech failed: cannot open /Users/me/voices/a.safetensors")
    assert "/Users" not in str(error.body()) and ".../a.safetensors" in error.message


def test_the_chat_protocols_error_names_no_folder():
    message = chat_protocol.error("cannot start a conversation: no /Users/me/voices/v.pt")
    assert (
        message == bytes([chat_protocol.Kind.ERROR]) + b"cannot start a conversation: no .../v.pt"
    )


def test_a_local_model_is_named_by_its_folder_and_answers_to_both(tmp_path):
    folder = tmp_path / "models" / "stt-1b"
    folder.mkdir(parents=True)
    context = ServeContext(None, EventTally(logging.getLogger("test")))
    context.add_model("stt", str(folder))
    context.add_model("tts", "kyutai/tts-1.6b-en_fr")
    assert context.model_names == {"stt": "stt-1b", "tts": "kyutai/tts-1.6b-en_fr"}
    assert context.is_model("stt", "stt-1b") and context.is_model("stt", str(folder))
    assert not context.is_model("stt", "kyutai/tts-1.6b-en_fr")
