"""The TTS model's voice cache (`VoiceCache`): a request in a voice used lately reads no voice
file and projects nothing, and speaks exactly as the first request in that voice did; a
voice file rewritten is read again; only the last few voices are kept; a voice given as its
embedding (`VoiceEmbedding`) speaks as its file does and is known again by its content."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tiny_moshi import load_tiny_tts
from tiny_tts import TINY_TTS_VOICES

import moshi_mlx.tts.voices as voices_module
from moshi_mlx.errors import TtsError
from moshi_mlx.models.lm import Lm
from moshi_mlx.tts.synthesizer import SKIPPED_FRAMES, TtsModel, TtsRequest
from moshi_mlx.tts.voices import VOICE_TENSOR, VOICES_KEPT, Voice, VoiceEmbedding

ALICE = TINY_TTS_VOICES["alice"]
BOB = TINY_TTS_VOICES["bob"]
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


def _speak(model: TtsModel, voice: Voice, seed: int = 7):
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


def _embedding_of(path: Path) -> np.ndarray:
    return np.array(mx.load(str(path))[VOICE_TENSOR])  # (1, dim, frames) float32


def test_an_embedding_speaks_as_the_file_that_holds_it(model, reads):
    """Sample for sample, and with no file read."""
    given = _speak(model, VoiceEmbedding(_embedding_of(ALICE)))
    assert reads["files"] == 0
    np.testing.assert_array_equal(given.pcm, _speak(replace(model), ALICE).pcm)


def test_the_same_embedding_given_again_is_projected_once(model, reads):
    """Another array with the same values (as a client sending its voice again) is known by
    its content: no second projection, the same audio."""
    first = _speak(model, VoiceEmbedding(_embedding_of(ALICE)))
    after_first = dict(reads)
    assert after_first["projections"] >= 1
    again = _speak(model, VoiceEmbedding(_embedding_of(ALICE)))
    assert reads == after_first
    np.testing.assert_array_equal(again.pcm, first.pcm)
    kept = [identities for identities, _ in model.voice_cache.keys_values.choices()]
    assert len(kept) == 1  # and the voice files' places left as they were
    _speak(model, VoiceEmbedding(_embedding_of(BOB)))
    assert reads["projections"] > after_first["projections"]


def test_an_embedding_is_a_copy_the_caller_may_change_known_by_its_values():
    array = _embedding_of(ALICE)
    voice = VoiceEmbedding(array)
    array[:] = 0
    assert voice.key != VoiceEmbedding(array).key
    assert voice.key == VoiceEmbedding(_embedding_of(ALICE)).key
    assert voice.key == VoiceEmbedding(np.asfortranarray(_embedding_of(ALICE))).key


WRONG_WIDTH = r"has shape \[1, 3, 4\], this model needs \[1, 16, frames\] with at least one frame"


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((1, 3, 4), np.float32), f"the voice embedding {WRONG_WIDTH}$"),
        (np.zeros((16, 4), np.float32), r"the voice embedding has shape \[16, 4\]"),
        (np.full((1, 16, 4), np.nan, np.float32), "the voice embedding must hold finite floats"),
        (np.zeros((1, 16, 4), np.int32), "a voice embedding holds floats, not int32"),
    ],
)
def test_a_bad_embedding_is_refused_in_one_line(model, array, message):
    with pytest.raises(TtsError, match=f"^{message}") as caught:
        model.voice(VoiceEmbedding(array))
    assert "\n" not in str(caught.value)
