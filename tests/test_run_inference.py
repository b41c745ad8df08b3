"""`python -m moshi_mlx.run_inference` on espeak-ng speech with tiny random weights."""

import numpy as np
import pytest
import soundfile as sf
from tiny_moshi import cached_tiny_moshi, espeak_speech, fast_codec, weight_flags

from moshi_mlx.run_inference import main

FRAME = 1920


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    # 44.1 kHz stereo, so reading also mixes down and resamples
    path = espeak_speech(
        tmp_path_factory.mktemp("speech") / "user.wav", "Hello Moshi, how are you?", 44100, 2
    )
    if path is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    return path


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    # rustymimi keeps this test short; the MLX codec runs in test_local_e2e.py
    return [*weight_flags(cached_tiny_moshi(tmp_path_factory)), "--codec", fast_codec()]


def _run(capsys, speech, out, flags, seed):
    code = main([str(speech), str(out), "--seed", str(seed), *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_same_seed_same_output_and_length(tmp_path, capsys, speech, flags):
    text_a = _run(capsys, speech, tmp_path / "a.wav", flags, seed=7)
    text_b = _run(capsys, speech, tmp_path / "b.wav", flags, seed=7)
    _run(capsys, speech, tmp_path / "c.wav", flags, seed=8)
    a, rate = sf.read(tmp_path / "a.wav", dtype="int16")
    b, _ = sf.read(tmp_path / "b.wav", dtype="int16")
    c, _ = sf.read(tmp_path / "c.wav", dtype="int16")
    info = sf.info(str(speech))
    expected = round(info.frames * 24000 / info.samplerate)
    assert rate == 24000 and a.ndim == 1
    assert abs(len(a) - expected) < FRAME
    np.testing.assert_array_equal(a, b)
    assert text_a == text_b
    assert not np.array_equal(a, c)  # the seed matters
    # Moshi is silent until its delays fill, then speaks (random weights: noise-like audio).
    assert not a[:FRAME].any() and np.abs(a[2 * FRAME :]).max() > 30


def test_never_overwrites_the_input_or_an_existing_file(tmp_path, capsys, speech, flags):
    recording = tmp_path / "me.wav"
    recording.write_bytes(speech.read_bytes())
    link = tmp_path / "link.wav"
    link.hardlink_to(recording)
    kept = recording.read_bytes()
    for output, message in (
        (recording, "is the input recording"),
        (link, "is the input recording"),
        (tmp_path / "missing" / "out.wav", "folder"),
        (tmp_path / "out.mp4", "use a .wav, .flac or .ogg"),
    ):
        assert main([str(recording), str(output), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert recording.read_bytes() == kept
    folder = tmp_path / "folder.wav"
    folder.mkdir()
    assert main([str(recording), str(folder), "--force", *flags]) == 2  # before any inference
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder" in err, err
    folder.rmdir()
    existing = tmp_path / "reply.wav"
    existing.write_bytes(b"mine")
    assert main([str(recording), str(existing), *flags]) == 2
    assert "--force" in capsys.readouterr().err and existing.read_bytes() == b"mine"
    assert main([str(recording), str(existing), "--seed", "1", "--force", *flags]) == 0
    assert sf.info(str(existing)).samplerate == 24000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav", "me.wav", "reply.wav"]
