"""The TTS model's voice cache (`VoiceCache`): a request in a voice used lately reads no voice
file and projects nothing, and speaks exactly as the first request in that voice did; a
voice file rewritten is read again; only the last few voices are kept."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import moshi_mlx.tts.voices as voices_module
from moshi_mlx.models.lm import Lm
from moshi_mlx.tts.synthesizer import SKIPPED_FRAMES, TtsModel, TtsRequest
from moshi_mlx.tts.voices import VOICES_KEPT
from tests.tiny_moshi import load_tiny_tts

FIXTURES = Path(__file__).parent / "fixtures" / "tts"
ALICE = FIXTURES / "voices" / "alice.safetensors"
BOB = FIXTURES / "voices" / "bob.safetensors"
TEXT = "Hi there."


@pytest.fixture(scope="module")
def loaded(full_mimi_checkpoint) -> TtsModel:
    return load_tiny_tts(full_mimi_checkpoint)


@pytest.fixture
def model(loaded) -> TtsModel:
    """The loaded model with empty caches."""
    return replace(loaded)


@pytest.fixture
def reads(monkeypatch) -> dict[str, int]:
    """Counts of voice files read and of voice projections (`Lm.cross_keys_values`)."""
    counts = {"files": 0, "projections": 0}
    load_voice, cross_keys_values = voices_module.load_voice, Lm.cross_keys_values

    def counted_load(*args, **kwargs):
        counts["files"] += 1
        return load_voice(*args, **kwargs)

    def counted_projection(self, *args, **kwargs):
        counts["projections"] += 1
        return cross_keys_values(self, *args, **kwargs)

    monkeypatch.setattr(voices_module, "load_voice", counted_load)
    monkeypatch.setattr(Lm, "cross_keys_values", counted_projection)
    return counts


def _steps(model: TtsModel) -> int:
    """Steps to 4 frames of audio (Mimi's full-size decoding is most of a test's time)."""
    return model.config.max_delay + model.delay_steps + SKIPPED_FRAMES + 4


def _speak(model: TtsModel, voice: Path, seed: int = 7):
    [speech] = model.synthesize([TtsRequest(TEXT, (voice,))], seed=seed, max_steps=_steps(model))
    assert speech.pcm.size
    return speech


def test_a_second_request_in_a_voice_reads_and_projects_nothing(model, reads):
    """Sampled (temp 0.6), same seed: the request that found its voice cached speaks as the
    one that read it, sample for sample, and as a model that never cached it."""
    first = _speak(model, ALICE)
    after_first = dict(reads)
    assert after_first["files"] == 1 and after_first["projections"] >= 1
    second = _speak(model, ALICE)
    assert reads == after_first  # no file read, no projection
    np.testing.assert_array_equal(second.pcm, first.pcm)
    np.testing.assert_array_equal(second.audio_codes, first.audio_codes)
    uncached = _speak(replace(model), ALICE)
    np.testing.assert_array_equal(uncached.pcm, first.pcm)


def test_a_batch_row_uses_its_voices_kept_keys_and_values(model, reads):
    """A batch of two voices after each was used alone projects nothing, and speaks as the
    same batch on a model that never cached them."""
    _speak(model, ALICE)
    _speak(model, BOB)
    before = dict(reads)
    requests = [TtsRequest(TEXT, (ALICE,)), TtsRequest(TEXT, (BOB,), cfg_coef=1.5)]
    cached = model.synthesize(requests, seed=3, max_steps=_steps(model))
    assert reads == before
    uncached = replace(model).synthesize(requests, seed=3, max_steps=_steps(model))
    for ours, theirs in zip(cached, uncached):
        np.testing.assert_array_equal(ours.pcm, theirs.pcm)


def test_a_rewritten_voice_file_is_read_again(model, reads, tmp_path):
    voice = tmp_path / "voice.safetensors"
    shutil.copy(ALICE, voice)
    _speak(model, voice)
    replacement = tmp_path / "replacement.safetensors"
    shutil.copy(BOB, replacement)
    os.replace(replacement, voice)  # same path, same size: another file
    files = reads["files"]
    rewritten = _speak(model, voice)
    assert reads["files"] == files + 1
    np.testing.assert_array_equal(rewritten.pcm, _speak(replace(model), BOB).pcm)


def test_only_the_last_voices_used_are_kept(model, tmp_path):
    """`VOICES_KEPT` voices' keys and values, the least recently used dropped first."""
    paths = []
    for index in range(VOICES_KEPT + 1):
        paths.append(tmp_path / f"voice{index}.safetensors")
        shutil.copy(ALICE if index % 2 else BOB, paths[-1])
    for path in paths:
        model.voice_keys_values([[path]])
    cache = model.voice_cache
    kept = [identities[0][0] for identities, _ in cache.keys_values.choices()]
    assert kept == [str(path.resolve()) for path in paths[1:]]
