"""The codec interface over our MLX Mimi and rustymimi, and both on real (synthetic) speech."""

from __future__ import annotations

import shutil
import subprocess
import sys
from math import ceil

import mlx.core as mx
import numpy as np
import pytest
from closeness import norm_relative
from conftest import needs_rustymimi

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.errors import AudioError, MoshiError, WeightsError
from moshi_mlx.runtime.codec import BatchEncoder, Codec, MlxCodec, RustyMimiCodec, load_codec

FRAME = 1920


def _round_trip(codec: Codec, pcm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stream pcm (T,), T a multiple of the frame size: codes (K, frames) and decoded pcm."""
    codec.reset()
    codes, decoded = [], []
    for frame in pcm.reshape(-1, FRAME):
        codes.append(codec.encode_step(frame))
        decoded.append(codec.decode_step(codes[-1]))
        mx.eval(codes[-1], decoded[-1], codec.state)  # one evaluation per frame
    return np.stack(codes, axis=1), np.concatenate(decoded)


@pytest.fixture(scope="module")
def codecs(full_mimi_checkpoint) -> dict[str, Codec]:
    needs_rustymimi()
    return {name: load_codec(full_mimi_checkpoint, name) for name in ("mlx", "rustymimi")}


def test_unknown_backend(tiny_mimi_checkpoint):
    path, _ = tiny_mimi_checkpoint
    with pytest.raises(MoshiError, match="unknown codec backend 'torch'; choose one of mlx"):
        load_codec(path, "torch")


def test_missing_rustymimi_is_a_clear_error(tiny_mimi_checkpoint, monkeypatch):
    path, _ = tiny_mimi_checkpoint
    monkeypatch.setitem(sys.modules, "rustymimi", None)  # makes `import rustymimi` fail
    with pytest.raises(MoshiError, match=r"pip install 'moshi_mlx\[rustymimi\]'"):
        load_codec(path, "rustymimi")


def test_rustymimi_rejects_a_wrong_file_in_one_line(tiny_mimi_checkpoint, tmp_path):
    needs_rustymimi()
    path, _ = tiny_mimi_checkpoint
    with pytest.raises(WeightsError, match="rustymimi cannot load .*shape mismatch") as error:
        load_codec(path, "rustymimi")
    assert "\n" not in str(error.value)
    with pytest.raises(WeightsError, match="not found"):
        load_codec(tmp_path / "missing.safetensors", "rustymimi")


def test_mlx_codec_frames(tiny_mimi_checkpoint, mimi_signal):
    path, config = tiny_mimi_checkpoint
    codec = MlxCodec(load_mimi(path, num_codebooks=4, config=config))
    assert isinstance(codec, Codec)
    assert (codec.sample_rate, codec.frame_size, codec.num_codebooks) == (24000, FRAME, 4)
    codes = codec.encode_step(mimi_signal(FRAME))
    assert codes.shape == (4,) and codes.dtype == mx.int32
    pcm = codec.decode_step(codes)
    assert pcm.shape == (FRAME,) and pcm.dtype == mx.float32
    with pytest.raises(AudioError, match="1920"):
        codec.encode_step(np.zeros(100, np.float32))
    with pytest.raises(AudioError, match=r"\(4,\)"):
        codec.decode_step(np.zeros(8, np.int32))


def test_reset_starts_a_fresh_stream(codecs, mimi_signal):
    pcm = mimi_signal(2 * FRAME)
    for codec in codecs.values():
        first = _round_trip(codec, pcm)  # _round_trip resets first
        second = _round_trip(codec, pcm)
        np.testing.assert_array_equal(first[0], second[0])
        np.testing.assert_allclose(first[1], second[1], rtol=0, atol=1e-6)


def test_rustymimi_fresh_streams_reuse_a_tokenizer_that_never_ran(
    full_mimi_checkpoint, mimi_signal, monkeypatch
):
    needs_rustymimi()
    import rustymimi

    opened = []
    tokenizer = rustymimi.Tokenizer
    monkeypatch.setattr(
        rustymimi, "Tokenizer", lambda *a, **k: opened.append(1) or tokenizer(*a, **k)
    )
    pcm = mimi_signal(2 * FRAME)
    model_codec = load_codec(full_mimi_checkpoint, "rustymimi")  # checks the file: opens it
    warm_up = model_codec.fresh()  # takes over the unused tokenizer
    first = _round_trip(warm_up, pcm)
    conversation = model_codec.fresh()  # the model's was handed over: opens one
    assert len(opened) == 2
    second = _round_trip(conversation, pcm)  # its reset before the first frame: no reopen
    assert len(opened) == 2
    third = _round_trip(conversation, pcm)  # a reset after frames opens the file again
    assert len(opened) == 3
    for other in (second, third):
        np.testing.assert_array_equal(first[0], other[0])
        np.testing.assert_allclose(first[1], other[1], rtol=0, atol=1e-6)


def test_a_batch_encoder_gives_each_stream_the_codes_it_gets_alone(codecs, mimi_signal):
    frames = 4
    signals = np.stack([mimi_signal(frames * FRAME, seed=seed) for seed in range(3)])
    for name, codec in codecs.items():
        alone = [_round_trip(codec.fresh(), pcm)[0] for pcm in signals]
        encoder = codec.batch_encoder(len(signals))
        assert isinstance(encoder, BatchEncoder)
        batched = []
        for frame in range(frames):
            batched.append(encoder.encode_frames(signals[:, frame * FRAME : (frame + 1) * FRAME]))
            mx.eval(batched[-1], encoder.state)
        batched = np.stack(batched, axis=2)  # (streams, K, frames)
        for stream, codes in enumerate(alone):
            np.testing.assert_array_equal(batched[stream], codes, err_msg=name)
        with pytest.raises(AudioError, match=r"\(3, 1920\)"):
            encoder.encode_frames(signals[:2, :FRAME])


def test_mlx_matches_rustymimi(codecs, mimi_signal):
    assert isinstance(codecs["rustymimi"], RustyMimiCodec)
    assert isinstance(codecs["rustymimi"], Codec)
    pcm = mimi_signal(5 * FRAME)
    ours_codes, ours_pcm = _round_trip(codecs["mlx"], pcm)
    rust_codes, rust_pcm = _round_trip(codecs["rustymimi"], pcm)
    agreement = float((ours_codes == rust_codes).mean())
    print(f"code agreement with rustymimi: {agreement:.1%}")
    assert ours_codes.shape == rust_codes.shape == (8, 5)
    assert agreement >= 0.9
    assert len(np.unique(ours_codes)) > 10
    # Decode identical codes with both.
    codecs["rustymimi"].reset()
    rust_pcm = np.concatenate([np.array(codecs["rustymimi"].decode_step(c)) for c in ours_codes.T])
    error = norm_relative(ours_pcm, rust_pcm)
    print(f"decoded pcm relative error vs rustymimi: {error:.2e}")
    assert error < 1e-4


def _espeak_speech(tmp_path) -> np.ndarray:
    """Synthetic English speech at 24 kHz, float32 (espeak-ng speaks at 22050 Hz)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed")
    wav = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "Testing Mimi."], check=True, capture_output=True)
    return read_audio(wav, sample_rate=24_000)


def test_speech_keeps_length_and_frame_rate(codecs, tmp_path):
    import mlx.core as mx

    speech = _espeak_speech(tmp_path)
    seconds = len(speech) / 24000
    assert 0.5 < seconds < 3.0
    mimi = codecs["mlx"].model
    codes = np.array(mimi.encode(mx.array(speech)[None, None]))
    frames = ceil(len(speech) / FRAME)
    assert codes.shape == (1, 8, frames)
    assert abs(frames / seconds - 12.5) < 12.5 / frames + 1e-9  # 12.5 frames per second
    decoded = np.array(mimi.decode(mx.array(codes)))[0, 0]
    assert decoded.shape == (frames * FRAME,)
    assert decoded[: len(speech)].shape == speech.shape
    assert np.isfinite(decoded).all() and np.abs(decoded).max() > 0

    # rustymimi streaming on the same speech gives (nearly) the same codes.
    padded = np.pad(speech, (0, frames * FRAME - len(speech)))
    rust_codes, _ = _round_trip(codecs["rustymimi"], padded)
    agreement = float((rust_codes == codes[0]).mean())
    print(f"speech: {seconds:.2f} s, {frames} frames, code agreement MLX/rustymimi {agreement:.1%}")
    # Random codebooks make near-ties; one flip changes the later acoustic levels of its frame.
    assert agreement >= 0.85
    assert (rust_codes[0] == codes[0, 0]).mean() >= 0.9  # semantic codebook


def test_a_small_mimi_loads_by_its_path_alone(tiny_mimi_checkpoint, mimi_signal, tmp_path):
    """A Mimi file other than the published model carries its config in its metadata: the
    loaders build it from the path alone (the assistant's end-to-end test loads one by path)."""
    from safetensors.numpy import load_file, save_file

    from moshi_mlx.checkpoints.io import read_safetensors
    from moshi_mlx.checkpoints.mimi import MIMI_CONFIG_KEY, mimi_config_from_metadata

    path, config = tiny_mimi_checkpoint
    assert mimi_config_from_metadata(read_safetensors(path).metadata, path) == config
    given, found = MlxCodec(load_mimi(path, 8, config)), load_codec(path, "mlx", 8)
    frame = mimi_signal(FRAME)
    np.testing.assert_array_equal(given.encode_step(frame), found.encode_step(frame))
    broken = tmp_path / "broken.safetensors"
    save_file(load_file(str(path)), str(broken), metadata={MIMI_CONFIG_KEY: "{not json"})
    with pytest.raises(WeightsError, match="mimi_config metadata is not valid"):
        load_codec(broken, "mlx", 8)
