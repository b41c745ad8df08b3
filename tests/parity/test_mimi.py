"""Mimi in MLX: golden parity with Kyutai's PyTorch Mimi, and streaming == batch."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from closeness import norm_relative
from conftest import MIMI_FIXTURES

from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.errors import AudioError, ConfigError
from moshi_mlx.models.mimi import Mimi, MimiConfig, MimiState

FRAME = 1920


@pytest.fixture(scope="module")
def golden() -> tuple[Mimi, dict[str, np.ndarray]]:
    """Our Mimi on the reference's random weights, and the reference's outputs."""
    config = MimiConfig.from_dict(json.loads((MIMI_FIXTURES / "config.json").read_text()))
    mimi = load_mimi(MIMI_FIXTURES / "weights.safetensors", num_codebooks=8, config=config)
    return mimi, dict(np.load(MIMI_FIXTURES / "golden.npz"))


@pytest.fixture(scope="module")
def tiny_mimi(tiny_mimi_checkpoint) -> Mimi:
    path, config = tiny_mimi_checkpoint
    return load_mimi(path, num_codebooks=8, config=config)


def test_fixture_config_is_the_tiny_preset():
    config = json.loads((MIMI_FIXTURES / "config.json").read_text())
    assert MimiConfig.from_dict(config) == MimiConfig.tiny()


def test_latent_matches_reference(golden):
    mimi, ref = golden
    latent = np.array(mimi.encode_latent(mx.array(ref["pcm"])))
    assert latent.shape == ref["latent"].shape == (1, 32, 8)  # 14440 samples -> 8 frames
    assert norm_relative(latent, ref["latent"]) < 1e-4


def test_codes_match_reference(golden):
    mimi, ref = golden
    codes = np.array(mimi.encode(mx.array(ref["pcm"])))
    assert codes.shape == ref["codes"].shape == (1, 8, 8)
    agreement = float((codes == ref["codes"]).mean())
    print(f"code agreement with PyTorch: {agreement:.1%}")
    assert agreement >= 0.95
    assert (codes[:, 0] == ref["codes"][:, 0]).all()  # the semantic codebook has no near-ties


@pytest.mark.parametrize(
    "codes_key, pcm_key", [("given_codes", "decoded_given"), ("codes", "decoded")]
)
def test_decoded_pcm_matches_reference(golden, codes_key, pcm_key):
    mimi, ref = golden
    pcm = np.array(mimi.decode(mx.array(ref[codes_key])))
    assert pcm.shape == ref[pcm_key].shape == (1, 1, 8 * FRAME)
    assert norm_relative(pcm, ref[pcm_key]) < 1e-4


def _stream(
    mimi: Mimi, pcm: np.ndarray, state: MimiState | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Encode then decode frame by frame through `state` (reset first; a fresh one if None);
    pcm (B, 1, T), T a multiple of the frame size."""
    state = state or mimi.make_state()
    state.reset()
    codes, out = [], []
    for start in range(0, pcm.shape[-1], FRAME):
        frame_codes = mimi.encode_step(mx.array(pcm[..., start : start + FRAME]), state)
        frame_pcm = mimi.decode_step(frame_codes, state)
        mx.eval(frame_codes, frame_pcm, state.state)
        codes.append(np.array(frame_codes))
        out.append(np.array(frame_pcm))
    return np.concatenate(codes, axis=-1), np.concatenate(out, axis=-1)


def test_streaming_equals_batch_with_odd_length(tiny_mimi, mimi_signal):
    samples = 6 * FRAME + 123  # padded, not dropped: 7 frames
    pcm = np.stack([mimi_signal(samples, seed) for seed in (0, 1)])[:, None, :]  # batch of 2
    codes = np.array(tiny_mimi.encode(mx.array(pcm)))
    assert codes.shape == (2, 8, 7)
    decoded = np.array(tiny_mimi.decode(mx.array(codes)))
    assert decoded.shape == (2, 1, 7 * FRAME)

    padded = np.pad(pcm, [(0, 0), (0, 0), (0, 7 * FRAME - samples)])
    stream_codes, stream_pcm = _stream(tiny_mimi, padded)
    np.testing.assert_array_equal(stream_codes, codes)
    assert norm_relative(stream_pcm, decoded) < 1e-5
    assert len(np.unique(codes[:, 1:])) > 10  # the random codebooks are really used


def test_reset_restarts_the_stream(tiny_mimi, mimi_signal):
    pcm = mimi_signal(3 * FRAME)[None, None]
    state = tiny_mimi.make_state()
    first = _stream(tiny_mimi, pcm, state)
    second = _stream(tiny_mimi, pcm, state)  # _stream calls state.reset() first
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])
    # Without reset the state carries over: the next frame differs from a fresh start.
    carried = np.array(tiny_mimi.decode_step(mx.array(first[0][..., :1]), state))
    assert not np.allclose(carried, first[1][..., :FRAME])


def test_fewer_codebooks_give_a_prefix_of_the_codes(tiny_mimi_checkpoint, tiny_mimi, mimi_signal):
    path, config = tiny_mimi_checkpoint
    pcm = mx.array(mimi_signal(4 * FRAME)[None, None])
    all_codes = np.array(tiny_mimi.encode(pcm))
    for num_codebooks in (1, 3):
        mimi = load_mimi(path, num_codebooks=num_codebooks, config=config)
        codes = np.array(mimi.encode(pcm))
        np.testing.assert_array_equal(codes, all_codes[:, :num_codebooks])
        assert mimi.decode(mx.array(codes)).shape == (1, 1, 4 * FRAME)


def test_step_shapes_are_checked(tiny_mimi):
    with pytest.raises(AudioError, match="1920"):
        tiny_mimi.encode_step(mx.zeros((1, 1, 1000)), tiny_mimi.make_state())
    with pytest.raises(AudioError, match="8, 1"):
        tiny_mimi.decode_step(mx.zeros((1, 4, 1), dtype=mx.uint32), tiny_mimi.make_state())


def test_full_size_streaming_equals_batch(full_mimi_checkpoint, mimi_signal):
    mimi = load_mimi(full_mimi_checkpoint, num_codebooks=8)
    pcm = mimi_signal(3 * FRAME)[None, None]
    codes = np.array(mimi.encode(mx.array(pcm)))
    decoded = np.array(mimi.decode(mx.array(codes)))
    stream_codes, stream_pcm = _stream(mimi, pcm)
    np.testing.assert_array_equal(stream_codes, codes)
    assert norm_relative(stream_pcm, decoded) < 1e-5
    assert decoded.shape == (1, 1, 3 * FRAME)


def test_config_from_dict_rejects_unsupported_options():
    config = json.loads((MIMI_FIXTURES / "config.json").read_text())
    config["transformer"]["gating"] = "silu"
    with pytest.raises(ConfigError, match="transformer.gating = 'silu' is not supported"):
        MimiConfig.from_dict(config)


def test_long_stream_past_the_attention_context(tiny_mimi, mimi_signal):
    """140 frames = 280 steps of each transformer: the KV rings wrap, batch masks the window."""
    frames = 140
    pcm = mimi_signal(frames * FRAME)[None, None]
    codes = np.array(tiny_mimi.encode(mx.array(pcm)))
    decoded = np.array(tiny_mimi.decode(mx.array(codes)))
    stream_codes, stream_pcm = _stream(tiny_mimi, pcm)
    np.testing.assert_array_equal(stream_codes, codes)
    late = slice(126 * FRAME, None)
    assert norm_relative(stream_pcm[..., late], decoded[..., late]) < 1e-5
