"""`tts.prefix.request_voices`, the one reading of a `--voice` list that `tts` and `assistant`
share: a recording among the voices is cloned (its Mimi codes are the audio prefix), the
others are the speaker embeddings; a TTS of cloned voices only (no cross-attention:
kyutai/tts-0.75b-en-public) requires one recording and no named voice. And the assistant's
`--voice` flag, which takes a recording too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.cli.assistant import parse_args
from moshi_mlx.cli.common import as_flag
from moshi_mlx.errors import TtsError
from moshi_mlx.models.mimi import Mimi, MimiConfig
from moshi_mlx.tts.prefix import recording_codes, request_voices
from moshi_mlx.tts.voices import DEFAULT_VOICE

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tts"
EMBEDDINGS = lm_config_of(FIXTURES / "weights.safetensors")  # the tiny 1.6B: voice embeddings
assert EMBEDDINGS.cross_attention


@pytest.fixture(scope="module")
def mimi() -> Mimi:
    return Mimi(MimiConfig.tiny(), 8)


@pytest.fixture(scope="module")
def clones_only():
    """A config like kyutai/tts-0.75b-en-public's: no cross-attention (no voice embeddings)."""
    return replace(EMBEDDINGS, cross_attention=False, fuser=replace(EMBEDDINGS.fuser, cross=()))


@pytest.fixture
def recording(tmp_path) -> Path:
    path = tmp_path / "speech.wav"
    noise = np.random.default_rng(0).standard_normal(24_000).astype(np.float32)
    sf.write(path, 0.1 * noise, 24_000)
    return path


def test_a_recording_is_cloned_beside_the_voices_named(mimi, recording):
    voices, prefix = request_voices(["alice", str(recording)], EMBEDDINGS, mimi)
    assert voices == ("alice",)
    np.testing.assert_array_equal(prefix, recording_codes(mimi, recording))
    assert request_voices([str(recording)], EMBEDDINGS, mimi)[0] == (DEFAULT_VOICE,)
    assert request_voices([], EMBEDDINGS, mimi) == ((DEFAULT_VOICE,), None)


def test_a_tts_of_cloned_voices_only_takes_one_recording(mimi, clones_only, recording):
    voices, prefix = request_voices([str(recording)], clones_only, mimi)
    assert voices == (DEFAULT_VOICE,)  # not read: the model has no cross-attention
    assert prefix is not None and prefix.shape[1] > 0
    for given in ([], ["alice"], [str(recording.with_name("absent.wav"))]):
        with pytest.raises(TtsError) as caught:
            request_voices(given, clones_only, mimi)
        assert caught.value.parameter == "voice"
        assert "give --voice speech.wav" in caught.value.spelled(as_flag)
    absent = recording.with_name("absent.wav")  # a typo in a path: the error names it
    with pytest.raises(TtsError, match=f"there is no file {absent}; give"):
        request_voices([str(absent)], clones_only, mimi)
    with pytest.raises(TtsError, match="no named voices"):
        request_voices(["alice", str(recording)], clones_only, mimi)


def test_the_assistants_voice_is_a_name_a_file_or_a_recording(capsys):
    assert parse_args([]).voice is None  # the default voice, or a refusal for a cloning TTS
    assert parse_args(["--voice", "speech.wav"]).voice == "speech.wav"
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "or a recording (.wav, .flac, ...) whose voice it clones" in shown
