"""Frame queues, the live loop's lag handling and latency, resampling and wav reading."""

import threading
import time

import numpy as np
import pytest
import soundfile as sf

from moshi_mlx.audio.frame_queue import FrameQueue, StampLog
from moshi_mlx.audio.live import LiveLoop
from moshi_mlx.audio.resample import Resampler, resample
from moshi_mlx.audio.wav import WavRecorder, decode_audio, read_audio
from moshi_mlx.errors import AudioError

FRAME = 1920


def test_frame_queue_fifo_overflow_and_drop():
    queue = FrameQueue(capacity=3, frame_size=4)
    out = np.zeros(4, np.float32)
    assert queue.pop_into(out) is None
    for i in range(4):
        assert queue.push(np.full(4, i, np.float32), stamp=10.0 + i) is (i < 3)
    assert len(queue) == 3 and queue.overflows == 1
    assert queue.pop_into(out) == 10.0 and out.tolist() == [0, 0, 0, 0]
    assert queue.drop_oldest(1) == 1
    assert queue.pop_into(out) == 12.0 and out.tolist() == [2, 2, 2, 2]
    # wrap around; short input is zero-padded, long input cut
    assert queue.push(np.ones(2, np.float32), 20.0) and queue.push(np.arange(6.0), 21.0)
    assert queue.pop_into(out) == 20.0 and out.tolist() == [1, 1, 0, 0]
    assert queue.pop_into(out) == 21.0 and out.tolist() == [0, 1, 2, 3]
    assert len(queue) == 0 and queue.drop_oldest(5) == 0


def test_frame_queue_threads_keep_every_frame_in_order():
    queue = FrameQueue(capacity=8, frame_size=16)
    n = 2000
    received = []

    def consume():
        out = np.zeros(16, np.float32)
        while len(received) < n:
            if queue.pop_into(out) is not None:
                assert (out == out[0]).all()
                received.append(int(out[0]))
            else:
                time.sleep(1e-4)

    consumer = threading.Thread(target=consume)
    consumer.start()
    i = 0
    while i < n:
        if queue.push(np.full(16, i, np.float32)):
            i += 1
        else:
            time.sleep(1e-4)
    consumer.join(10)
    assert received == list(range(n))


def test_stamp_log_stops_storing_at_capacity():
    log = StampLog(3)
    for v in range(5):
        log.append(float(v))
    assert log.count == 5 and log.values().tolist() == [0.0, 1.0, 2.0]


def _drive(loop: LiveLoop, seconds: float) -> None:
    """Call the callbacks like a sound card would: one input and one output block per 80 ms."""
    indata = np.zeros((FRAME, 1), np.float32)
    outdata = np.zeros((FRAME, 1), np.float32)
    start = time.monotonic()
    for k in range(int(seconds / 0.08)):
        indata[:, 0] = k + 1  # frame k carries the value k + 1
        loop.input_callback(indata, FRAME, None, None)
        loop.output_callback(outdata, FRAME, None, None)
        delay = start + (k + 1) * 0.08 - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _run_loop(step_seconds: float, seconds: float = 2.0, hiccups: tuple[int, ...] = ()):
    """Drive a LiveLoop whose model takes `step_seconds`, and 0.2 s on the `hiccups` frames."""
    seen = []
    messages = []

    def step(pcm):
        seen.append(int(pcm[0]))
        time.sleep(0.2 if int(pcm[0]) in hiccups else step_seconds)
        return pcm * 0.5, ""

    loop = LiveLoop(step, max_lag_frames=3, on_status=messages.append, status_every=1)
    worker = threading.Thread(target=loop.run)
    worker.start()
    _drive(loop, seconds)
    loop.stop_event.set()
    worker.join(2)
    loop.close()
    return loop, seen, messages


def test_live_loop_in_real_time_keeps_every_frame():
    loop, seen, messages = _run_loop(step_seconds=0.01)
    stats = loop.stats()
    assert seen == list(range(1, len(seen) + 1)) and len(seen) >= 24
    assert stats.dropped_frames == 0 and not any(m.startswith("lag") for m in messages)
    assert "latency" in messages[0] and "(median, last 1 s)" in messages[0]
    assert 12.0 < stats.as_dict()["input_rate_hz"] < 13.0
    # reply k is played by the output callback of frame k + 1 (k + 2 after a late step, if
    # the loaded machine made one late)
    assert len(stats.latencies) >= 23
    assert stats.latencies.max() < 0.2
    if stats.speaker_underruns == 0:
        assert np.median(stats.latencies) < 0.1


def test_live_loop_hiccups_do_not_add_up_to_latency():
    loop, _, _ = _run_loop(step_seconds=0.01, seconds=3.0, hiccups=(5, 12, 19, 26))
    stats = loop.stats()
    # Each 0.2 s hiccup would otherwise delay every later reply by one or two more blocks
    # (0.4+ s after four); with at most one block of slack the latency stays at two blocks.
    assert np.median(stats.latencies[-5:]) < 0.17
    assert stats.latencies.max() < 0.2 + 0.08 + 0.05
    assert stats.speaker_underruns >= 2 and stats.speaker_dropped >= 2


def test_live_loop_when_slow_drops_oldest_frames_and_does_not_drift():
    loop, seen, messages = _run_loop(step_seconds=0.3, seconds=3.0)
    stats = loop.stats()
    assert stats.dropped_frames > 10 and stats.lag_events >= 3
    assert any(m.startswith("lag:") for m in messages)
    assert seen == sorted(seen)  # still in order, frames skipped
    # No drift: a frame never waits for the model longer than max_lag frames (+ one block),
    # so the latency is bounded by that wait, one model step and one output block.
    assert stats.mic_waits.max() < (3 + 1) * 0.08 + 0.05
    assert stats.latencies.max() < stats.mic_waits.max() + stats.step_times.max() + 0.08 + 0.05


def _sine(rate, freq, seconds=1.0, channels=1):
    t = np.arange(int(rate * seconds)) / rate
    tone = 0.5 * np.sin(2 * np.pi * freq * t)
    return np.stack([tone] * channels, axis=1) if channels > 1 else tone


@pytest.mark.parametrize("rate_in", [8000, 16000, 22050, 44100, 48000])
def test_resample_matches_the_ideal_sine(rate_in):
    out = resample(_sine(rate_in, 1000.0), rate_in, 24000)
    assert len(out) == 24000 and out.dtype == np.float32
    ideal = _sine(24000, 1000.0)
    inner = slice(500, -500)  # edges see the zero padding
    assert np.abs(out[inner] - ideal[inner]).max() < 1e-3


def test_resample_removes_tones_above_the_new_nyquist():
    out = resample(_sine(48000, 15000.0), 48000, 24000)  # 15 kHz cannot exist at 24 kHz
    assert np.abs(out[500:-500]).max() < 0.01


def test_read_audio_mixes_to_mono_and_resamples(tmp_path):
    left = _sine(44100, 440.0, 0.5)
    stereo = np.stack([left, -0.5 * left], axis=1)  # mono mix = 0.25 * left
    sf.write(tmp_path / "s.wav", stereo, 44100, subtype="FLOAT")
    pcm = read_audio(tmp_path / "s.wav")
    assert pcm.shape == (12000,)
    ideal = 0.25 * _sine(24000, 440.0, 0.5)
    assert np.abs(pcm[300:-300] - ideal[300:-300]).max() < 1e-3


def test_resampling_block_by_block_is_resampling_the_whole():
    pcm = np.random.default_rng(0).standard_normal(30_011).astype(np.float32)
    resampler = Resampler(44100, 24000)
    parts = [resampler.push(pcm[start : start + 777]) for start in range(0, len(pcm), 777)]
    blocks = np.concatenate([*parts, resampler.finish()])
    np.testing.assert_array_equal(blocks, resample(pcm, 44100, 24000))


@pytest.mark.parametrize(("rate", "channels"), [(96_000, 6), (192_000, 2), (16_000, 3)])
def test_any_rate_and_channel_count_is_mixed_down_and_resampled(tmp_path, rate, channels):
    """A 6-channel 96 kHz file (and others) reads as 24 kHz mono, also under a cap in
    seconds: its memory is the output's, whatever the source's rate."""
    tone = _sine(rate, 440.0, 0.5)
    multi = np.zeros((len(tone), channels))
    multi[:, 0] = tone  # mono mix = tone / channels
    sf.write(tmp_path / "m.flac", multi, rate, subtype="PCM_24")
    ideal = _sine(24000, 440.0, 0.5) / channels
    for pcm in (
        read_audio(tmp_path / "m.flac"),
        decode_audio((tmp_path / "m.flac").read_bytes(), 24000, max_seconds=1.0),
    ):
        assert pcm.shape == (12000,)
        assert np.abs(pcm[300:-300] - ideal[300:-300]).max() < 1e-3
    with pytest.raises(AudioError, match="lasts 0.5 s, more than the 0.25 s allowed"):
        decode_audio((tmp_path / "m.flac").read_bytes(), 24000, max_seconds=0.25)


def test_bytes_that_are_no_audio_or_nothing_say_so_without_a_python_object():
    with pytest.raises(AudioError) as caught:
        decode_audio(b"these are not the samples\n" * 20, name="the file")
    assert str(caught.value) == (
        "cannot read the file as audio (Format not recognised.); give a valid wav/flac/ogg file"
    )
    with pytest.raises(AudioError, match="^the file is empty; give a wav/flac/ogg file$"):
        decode_audio(b"", name="the file")


def test_read_audio_errors(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(AudioError, match="empty.wav is empty"):
        read_audio(tmp_path / "empty.wav")
    with pytest.raises(AudioError, match="not found"):
        read_audio(tmp_path / "missing.wav")
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 4)
    with pytest.raises(AudioError, match="cannot read .*bad.wav as audio"):
        read_audio(tmp_path / "bad.wav")
    sf.write(tmp_path / "low.wav", _sine(4000, 300.0), 4000)
    with pytest.raises(AudioError, match="4000 Hz, too low for speech"):
        read_audio(tmp_path / "low.wav")


def test_wav_recorder_writes_two_channels(tmp_path):
    rec = WavRecorder(tmp_path / "r.wav", channels=2)
    rec.write(np.full(FRAME, 0.25, np.float32), np.full(FRAME, -0.5, np.float32))
    rec.write(np.zeros(FRAME, np.float32), np.full(FRAME, 2.0, np.float32))  # clipped
    rec.close()
    data, rate = sf.read(tmp_path / "r.wav")
    assert rate == 24000 and data.shape == (2 * FRAME, 2)
    np.testing.assert_allclose(data[0], [0.25, -0.5], atol=1e-4)
    np.testing.assert_allclose(data[-1], [0.0, 1.0], atol=1e-4)


def test_wav_recorder_is_readable_before_close_and_never_overwrites(tmp_path):
    path = tmp_path / "r.wav"
    rec = WavRecorder(path, channels=2, sync_seconds=1.0)
    for _ in range(19):  # 1.52 s, not closed: as if the process had been killed
        rec.write(np.full(FRAME, 0.5, np.float32), np.zeros(FRAME, np.float32))
    data, rate = sf.read(path)
    assert rate == 24000 and data.shape == (13 * FRAME, 2)  # the header of the last sync
    np.testing.assert_allclose(data[:, 0], 0.5, atol=1e-4)
    rec.close()
    assert sf.info(path).frames == 19 * FRAME
    with pytest.raises(AudioError, match="already exists"):
        WavRecorder(path, channels=2)
    assert sf.info(path).frames == 19 * FRAME


def test_live_loop_hands_a_model_error_to_the_main_thread():
    def step(pcm):
        raise AudioError("model failed")

    loop = LiveLoop(step)
    worker = threading.Thread(target=loop.run)
    worker.start()
    loop.input_callback(np.zeros((FRAME, 1), np.float32), FRAME, None, None)
    assert loop.stop_event.wait(2)
    worker.join(2)
    loop.close()
    assert not worker.is_alive() and isinstance(loop.error, AudioError)


def test_wav_recorder_goes_on_in_new_files_past_the_wav_size_limit(tmp_path):
    path = tmp_path / "r.wav"
    (tmp_path / "r.part2.wav").write_bytes(b"the user's own file")
    frames = 2.5 * FRAME  # per file, as if a wav file held only this many samples
    rec = WavRecorder(path, channels=2, part_bytes=int(frames * 2 * 2))
    ramp = np.arange(6 * FRAME, dtype=np.float32) / (8 * FRAME)
    for block in np.split(ramp, 6):
        rec.write(block, -block)
    rec.close()
    assert rec.paths == [path, tmp_path / "r.part3.wav", tmp_path / "r.part4.wav"]
    assert (tmp_path / "r.part2.wav").read_bytes() == b"the user's own file"
    parts = [sf.read(p)[0] for p in rec.paths]
    assert [len(p) for p in parts] == [int(frames), int(frames), FRAME]
    joined = np.concatenate(parts)
    np.testing.assert_allclose(joined[:, 0], ramp, atol=1e-4)
    np.testing.assert_allclose(joined[:, 1], -ramp, atol=1e-4)
