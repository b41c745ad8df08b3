"""A Realtime session's settings (`moshi_mlx.realtime.config`) and audio formats
(`moshi_mlx.realtime.formats`): turn detection onto the pause head, the session object as the
`openai` package's types read it, G.711 both ways."""

from __future__ import annotations

import numpy as np
import pytest
from openai.types.realtime.realtime_session_create_request import RealtimeSessionCreateRequest
from openai.types.realtime.realtime_transcription_session_create_request import (
    RealtimeTranscriptionSessionCreateRequest,
)

from moshi_mlx.assistant import TurnRules
from moshi_mlx.realtime.config import TRANSCRIPTION, SessionConfig, SessionError
from moshi_mlx.realtime.formats import PCMA, PCMU, AudioFormat, FrameCutter


def _vad(detection) -> SessionConfig:
    config = SessionConfig()
    config.update({"type": "realtime", "audio": {"input": {"turn_detection": detection}}})
    return config


def test_turn_detection_maps_onto_the_pause_head():
    base = TurnRules()
    assert _vad({"type": "server_vad"}).rules(base).pause_threshold == base.pause_threshold
    thresholds = [
        _vad({"type": "semantic_vad", "eagerness": e}).rules(base).pause_threshold
        for e in ("low", "medium", "high")
    ]
    assert thresholds == sorted(thresholds, reverse=True)  # eager: ends turns sooner
    manual = _vad(None).rules(base)
    assert not (manual.ends_turns or manual.replies or manual.barge_in)
    quiet = _vad({"type": "server_vad", "create_response": False, "interrupt_response": False})
    rules = quiet.rules(base)
    assert rules.ends_turns and not rules.replies and not rules.barge_in
    transcription = SessionConfig(kind=TRANSCRIPTION).rules(base)
    assert transcription.ends_turns and not transcription.replies


def test_the_session_objects_parse_as_the_openai_types():
    config = _vad({"type": "semantic_vad", "eagerness": "low"})
    config.update({"type": "realtime", "instructions": "Hi", "max_output_tokens": 100,
                   "audio": {"output": {"voice": {"id": "marin"}, "format": {"type": PCMA}}}})  # fmt: skip
    shown = RealtimeSessionCreateRequest.model_validate(config.as_dict("sess_1"))
    assert shown.instructions == "Hi" and shown.audio.output.voice == "marin"
    assert shown.audio.output.format.type == PCMA and shown.max_output_tokens == 100
    transcription = SessionConfig(kind=TRANSCRIPTION).as_dict("sess_2")
    RealtimeTranscriptionSessionCreateRequest.model_validate(transcription)


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ({"type": "realtime", "instructions": 5}, "session.instructions"),
        ({"type": "realtime", "max_output_tokens": 0}, "session.max_output_tokens"),
        ({"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
         "session.audio.input.format"),
        ({"type": "realtime", "audio": {"input": {"turn_detection": {"type": "semantic_vad",
          "eagerness": "eager"}}}}, "session.audio.input.turn_detection"),
        ({"type": "realtime", "audio": []}, "session.audio"),
    ],
)  # fmt: skip
def test_a_bad_value_names_its_field_and_changes_nothing(session, param):
    config = SessionConfig(instructions="kept")
    with pytest.raises(SessionError) as caught:
        config.update(session)
    assert caught.value.param == param
    assert config.instructions == "kept"


def test_g711_round_trips_and_silence_codes():
    assert AudioFormat(PCMU).encode(np.zeros(3, np.float32)) == b"\xff"  # 3 -> 1 sample at 8k
    assert AudioFormat(PCMA).encode(np.zeros(3, np.float32)) == b"\xd5"
    tone = (0.5 * np.sin(2 * np.pi * 300 * np.arange(2400) / 24000)).astype(np.float32)
    for kind in (PCMU, PCMA):
        audio_format = AudioFormat(kind)
        back = audio_format.decode(audio_format.encode(tone))
        assert len(back) == len(tone)
        assert np.sqrt(np.mean((back[200:-200] - tone[200:-200]) ** 2)) < 0.02


def test_frames_are_cut_from_chunks_of_any_length():
    cutter = FrameCutter()
    assert cutter.add(np.ones(1000, np.float32)) == []
    (frame,) = cutter.add(np.ones(1000, np.float32))
    assert frame.shape == (1920,)
    rest = cutter.rest()
    assert rest.shape == (1920,) and rest[:80].all() and not rest[80:].any()
    assert cutter.rest() is None
