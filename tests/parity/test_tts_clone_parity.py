"""Voice cloning with an audio prefix against Kyutai's PyTorch TTS (`moshi` 0.2.13
`TTSModel.generate(prefixes=...)`; fixtures: scripts/make_tts_clone_fixtures.py) on the tiny
TTS checkpoint of tests/fixtures/tts, float32, greedy: the text held at "no input" while the
prefix lasts, the prefix's codes forced at each codebook's delay, then the text schedule;
every fed token, every frame, the end step and the transcript equal."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.errors import AudioError, TtsError
from moshi_mlx.models.mimi import Mimi, MimiConfig
from moshi_mlx.runtime.sampling import GREEDY, Sampling
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.prefix import AudioPrefixes, recording_codes, split_recording
from moshi_mlx.tts.stepper import TtsStepper
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun
from moshi_mlx.tts.voices import DEFAULT_VOICE, is_recording

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts"
GOLDEN = Path(__file__).parents[1] / "fixtures" / "tts_clone" / "golden.json"


@pytest.fixture(scope="module")
def model():
    config = lm_config_of(FIXTURES / "weights.safetensors")
    lm = load_lm(FIXTURES / "weights.safetensors", config, dtype=mx.float32)
    tokenizer = load_tokenizer(FIXTURES / "tokenizer.model")
    return TtsModel(lm, codec=None, tokenizer=tokenizer, files=None)


def test_generation_after_an_audio_prefix_equals_the_reference(model):
    golden = json.loads(GOLDEN.read_text())
    row = golden["row"]
    prefix = np.array(golden["prefix"])[1:]  # the codebooks (row 0 is the text: -1)
    voice = FIXTURES / "voices" / f"{row['voice']}.safetensors"
    request = TtsRequest(row["text"], (voice,), row["cfg"], prefix=prefix)
    run = TtsRun(model, [request], GREEDY, GREEDY)
    schedule = run.schedules[0]
    schedule.push(model.entries(row["text"]))
    schedule.close()
    logged, frames = [], []
    while not run.finished:
        tokens = run.step_tokens()
        logged.append([tokens.predicted[0], tokens.fed[0]])
        if tokens.frame is not None:
            frames.append(np.array(tokens.frame[0]).tolist())
    assert run.step_index == golden["steps"]
    assert [fed for _, fed in logged] == [fed for _, fed in row["logged_text_tokens"]]
    assert logged == row["logged_text_tokens"]
    assert frames == row["frames"]
    assert schedule.end_step == row["end_step"]
    assert schedule.consumption_times == row["consumption_times"]
    assert [list(w) for w in schedule.transcript] == row["transcript"]
    assert run.prefixes.length(0) == prefix.shape[1] == 12


def test_a_prefix_must_be_codes(model):
    with pytest.raises(TtsError, match="an audio prefix is integer codes"):
        voice = FIXTURES / "voices" / "alice.safetensors"
        TtsRun(model, [TtsRequest("Hi.", (voice,), prefix=np.zeros((8,), np.int32))])


def test_a_recording_gives_its_codes_less_two_frames_and_is_checked():
    mimi = Mimi(MimiConfig.tiny(), 8)
    codes = recording_codes(mimi, np.zeros(24_000, np.float32))  # 1 s: 12.5 -> 13 frames
    assert codes.shape == (8, 11) and codes.dtype == np.int32
    with pytest.raises(AudioError, match="too short to clone a voice from"):
        recording_codes(mimi, np.zeros(2000, np.float32))
    with pytest.raises(AudioError, match="lasts 31.0 s; a voice to clone is at most 30 s"):
        recording_codes(mimi, np.zeros(31 * 24_000, np.float32))
    assert is_recording("speech.WAV") and not is_recording("alice.safetensors")


def test_a_voice_is_a_recording_when_its_audio_file_exists(tmp_path):
    """`split_recording`: an audio file that exists (a relative one in the folder given) is
    the recording; a voice named like one that is no file is a voice's name (Kyutai's end in
    .wav); the default voice when no other is given; two recordings are refused."""
    (tmp_path / "speech.wav").write_bytes(b"RIFF")
    (tmp_path / "other.flac").write_bytes(b"fLaC")
    name = "expresso/ex03-ex01_happy_001_channel1_334s.wav"
    assert split_recording([name]) == ((name,), None)
    assert split_recording(["speech.wav"], tmp_path) == ((DEFAULT_VOICE,), tmp_path / "speech.wav")
    assert split_recording(["a.safetensors", str(tmp_path / "speech.wav")]) == (
        ("a.safetensors",),
        tmp_path / "speech.wav",
    )
    with pytest.raises(TtsError, match="one recording to clone a voice from, not 2"):
        split_recording(["speech.wav", "other.flac"], tmp_path)


def _token_log(model, request, sampling, seed) -> tuple[list, list]:
    """Every step's (predicted, fed) text tokens and frames of `request` run alone."""
    run = TtsRun(model, [request], sampling, sampling, seed=seed)
    run.schedules[0].push(model.entries(request.text))
    run.schedules[0].close()
    logged, frames = [], []
    while not run.finished:
        tokens = run.step_tokens()
        logged.append((tokens.predicted[0], tokens.fed[0]))
        if tokens.frame is not None:
            frames.append(np.array(tokens.frame[0]).tolist())
    return logged, frames


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bf16"])
def test_the_prefix_steps_skip_the_depformer_and_change_no_token(dtype, monkeypatch):
    """While every codebook a step writes is the prefix's (or "no input"), the depformer
    does not run (`AudioPrefixes.replaced`): greedy and sampled (fixed seed), every token and
    frame equals a run whose depformer runs at every step (its samples replaced), the random
    draws of the later steps included (the depformer's come from a key of their own)."""
    config = lm_config_of(FIXTURES / "weights.safetensors")
    lm = load_lm(FIXTURES / "weights.safetensors", config, dtype=dtype)
    model = TtsModel(lm, None, load_tokenizer(FIXTURES / "tokenizer.model"), files=None)
    codes = np.random.default_rng(5).integers(0, config.card, (config.dep_q, 12))
    voice = FIXTURES / "voices" / "alice.safetensors"
    request = TtsRequest("Hello there, how are you?", (voice,), 2.0, prefix=codes)
    ran = []
    step = TtsStepper.step
    monkeypatch.setattr(TtsStepper, "step", lambda s, *a: ran.append(a[3]) or step(s, *a))
    for sampling, seed in ((GREEDY, 0), (Sampling(0.8, 50), 7)):
        ran.clear()
        skipped = _token_log(model, request, sampling, seed)
        start = model.delay_steps + min(config.delays[1:])
        assert ran[: start + 12] == [False] * (start + 12) and ran[start + 12]
        with monkeypatch.context() as always:
            always.setattr(AudioPrefixes, "replaced", lambda *_: False)
            assert skipped == _token_log(model, request, sampling, seed)
