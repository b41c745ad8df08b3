"""The embedding API on tiny random weights: shapes, silence before the delays fill,
determinism, independence of conversations, and errors."""

import json
from dataclasses import replace

import numpy as np
import pytest
from tiny_moshi import cached_tiny_moshi, fast_codec, load_tiny_model, tiny_config

from moshi_mlx.chat.model import MoshiModel, StepResult
from moshi_mlx.errors import AudioError, ConfigError, MoshiError, WeightsError
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.sampling import Sampling

FRAME = 1920


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cached_tiny_moshi(tmp_path_factory)


@pytest.fixture(scope="module")
def model(files):
    return load_tiny_model(files)


def _user_audio(n_frames: int) -> np.ndarray:
    t = np.arange(n_frames * FRAME) / 24000
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.5 * t)).astype(np.float32)


def _talk(conversation, audio):
    results = [conversation.step(audio[i : i + FRAME]) for i in range(0, len(audio), FRAME)]
    return np.stack([r.pcm for r in results]), "".join(r.text for r in results)


def test_step_shapes_and_silence_until_delays_fill(model):
    audio = _user_audio(5)
    with model.conversation(seed=1) as conv:
        results = [conv.step(audio[i * FRAME : (i + 1) * FRAME]) for i in range(5)]
    assert all(isinstance(r, StepResult) for r in results)
    assert all(r.pcm.shape == (FRAME,) and r.pcm.dtype == np.float32 for r in results)
    max_delay = max(tiny_config().delays)
    for i, r in enumerate(results):
        if i < max_delay:  # Moshi has produced no full frame yet
            assert not r.pcm.any()
        else:
            assert np.abs(r.pcm).max() > 1e-3
    assert all(isinstance(r.text, str) for r in results)


def test_seeded_conversations_repeat_and_reset_restarts(model):
    audio = _user_audio(4)
    sampling = Sampling(0.9, 25), Sampling(0.9, 250)
    with model.conversation(*sampling, seed=11) as conv:
        first = _talk(conv, audio)
        conv.reset()
        again = _talk(conv, audio)
    with model.conversation(*sampling, seed=11) as conv:
        fresh = _talk(conv, audio)
    with model.conversation(*sampling, seed=12) as conv:
        other = _talk(conv, audio)
    # Same tokens; rustymimi's float sums may differ in the last bits (~1e-8).
    np.testing.assert_allclose(first[0], again[0], atol=1e-6)
    np.testing.assert_allclose(first[0], fresh[0], atol=1e-6)
    assert first[1] == again[1] == fresh[1]
    assert np.abs(first[0] - other[0]).max() > 1e-5  # another seed: other tokens


def test_warm_up_compiles_the_step_and_changes_no_conversation(files):
    model = load_tiny_model(files)
    sampling = Sampling(0.9, 25), Sampling(0.9, 250)
    audio = _user_audio(4)
    with model.conversation(*sampling, seed=11) as conv:
        cold = _talk(conv, audio)
    model.compiled_steps.clear()  # forget the compiled steps
    model.warm_up(*sampling)
    assert model.compiled_steps.choices() == [(*sampling, None, 1.0)]
    with model.conversation(*sampling, seed=11) as conv:
        warm = _talk(conv, audio)
    np.testing.assert_allclose(cold[0], warm[0], atol=1e-6)
    assert cold[1] == warm[1]


def test_open_conversations_do_not_share_state(model):
    audio = _user_audio(4)
    with model.conversation(seed=3) as alone:
        expected = _talk(alone, audio)[0]
    a = model.conversation(seed=3)
    b = model.conversation(seed=5)  # a second codec is loaded for it
    assert a._codec is not b._codec
    interleaved = []
    for i in range(4):
        interleaved.append(a.step(audio[i * FRAME : (i + 1) * FRAME]).pcm)
        b.step(-audio[i * FRAME : (i + 1) * FRAME])
    a.close()
    b.close()
    np.testing.assert_allclose(np.stack(interleaved), expected, atol=1e-6)
    with pytest.raises(MoshiError, match="closed"):
        a.step(audio[:FRAME])


def test_step_rejects_wrong_frame_size(model):
    with model.conversation(seed=0) as conv, pytest.raises(AudioError, match="1920 samples"):
        conv.step(np.zeros(960, np.float32))


def test_lm_config_object_and_mismatches(files, tmp_path):
    kwargs = {
        "moshi_weight": files["moshi"],
        "mimi_weight": files["mimi"],
        "tokenizer": files["tokenizer"],
        "codec_backend": fast_codec(),
    }
    assert MoshiModel.load(lm_config=tiny_config(), **kwargs).lm.config == tiny_config()
    with pytest.raises(ConfigError, match="64 audio tokens per codebook but Mimi has 2048"):
        MoshiModel.load(lm_config=LmConfig.tiny(), **kwargs)
    wrong = tmp_path / "config.json"
    wrong.write_text(json.dumps(replace(tiny_config(), dim=32, num_heads=2).to_dict()))
    with pytest.raises(WeightsError, match=r"model.q4.safetensors: .*\(2049, 8\)"):
        MoshiModel.load(lm_config=wrong, **kwargs)
