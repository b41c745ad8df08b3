"""Echo cancellation: WebRTC AEC3 on the simulated echo path, and the far end lined up with
the microphone by `PlayedAudio` and the live loop."""

import threading
import time

import numpy as np
import pytest

from moshi_mlx.audio.echo import EchoCanceller, PlayedAudio
from moshi_mlx.audio.live import LiveLoop
from moshi_mlx.errors import AudioError
from moshi_mlx.testing import echo_path

RATE = 24_000


@pytest.fixture(scope="module")
def voices():
    far = echo_path.speak(echo_path.FAR_TEXT)
    near = echo_path.speak(echo_path.NEAR_TEXT, voice="en+f3", words_per_minute=170)
    if far is None or near is None:
        pytest.skip("espeak-ng is not installed (Debian: apt install espeak-ng)")
    return far, near


@pytest.mark.parametrize(("delay_s", "gain_db"), [(0.04, -6.0), (0.2, 0.0)])
def test_simulated_room(voices, delay_s, gain_db):
    scene, jump = echo_path.conversation_scene(*voices, delay_s=delay_s, gain_db=gain_db)
    out, cpu_ms = echo_path.run_canceller(EchoCanceller(RATE).process, scene)
    figures = echo_path.grade(scene, out, converge_s=2.0, jump_at=jump, recover_s=2.0)
    print(f"\n{delay_s * 1000:.0f} ms, {gain_db:+.0f} dB: {figures}, CPU {cpu_ms:.2f} ms / 80 ms")
    assert figures["erle_db"] >= 25
    assert abs(figures["double_talk_level_db"]) <= 6
    assert figures["double_talk_correlation"] >= 0.6
    assert figures["delay_ms"] <= 20  # the canceller's own delay: one 10 ms sub-frame or so
    assert figures["recovery_erle_db"] >= 20
    assert cpu_ms < 20


def test_the_canceller_checks_its_input():
    canceller = EchoCanceller(RATE)
    with pytest.raises(AudioError, match="multiple of 240 samples"):
        canceller.process(np.zeros(100, np.float32), np.zeros(100, np.float32))
    quiet = canceller.process(np.zeros(1920, np.float32), np.zeros(1920, np.float32))
    assert quiet.shape == (1920,) and quiet.dtype == np.float32


def test_played_audio_hands_out_what_was_sounding():
    played = PlayedAudio(RATE, seconds=1.0)
    ramp = np.arange(4 * 1920, dtype=np.float32)
    for k in range(4):  # blocks sound at 1.00, 1.08, 1.16, 1.24 s
        played.add(ramp[k * 1920 : (k + 1) * 1920], 1.0 + 0.08 * k)
    # the mic block captured from 1.10 s heard the far end from sample 0.10 * RATE on
    far = played.far_for(1920, 1.10)
    np.testing.assert_array_equal(far, ramp[2400 : 2400 + 1920])
    # callback jitter does not move the offset; samples not yet played are silence
    far = played.far_for(1920, 1.18 + 0.003)
    np.testing.assert_array_equal(far, ramp[4320 : 4320 + 1920])
    far = played.far_for(1920, 1.26)
    np.testing.assert_array_equal(far[:1440], ramp[6240:])
    assert not far[1440:].any() and played.moves == 0


def test_played_audio_follows_a_changed_delay():
    played = PlayedAudio(RATE, seconds=2.0, tolerance=0.01)
    block = np.ones(1920, np.float32)
    for k in range(20):
        played.add(block, 0.08 * k)
        shift = 0.05 if k >= 10 else 0.0  # from block 10 the mic is 50 ms later
        played.far_for(1920, 0.08 * k + shift)
    assert played.moves == 1 and played.offset == -round(0.05 * RATE)


def test_live_loop_cancels_the_echo_of_what_it_played(voices):
    """Callbacks driven like a sound card in a room: the mic hears what the speaker played
    60 ms earlier (and a little reverb); the model gets the mic without that echo."""
    far_speech = voices[0]
    heard = []
    step_index = [0]

    def step(pcm):
        heard.append(pcm.copy())
        k = step_index[0]
        step_index[0] += 1
        return far_speech[k * 1920 : (k + 1) * 1920], ""

    loop = LiveLoop(step, max_lag_frames=3, echo=EchoCanceller(RATE))
    loop.input_latency, loop.output_latency = 0.02, 0.03
    room = echo_path.room_impulse_response(0.2, 0.06, -3.0)
    # The devices' own delay: a sample played at an output callback sounds 30 ms later and,
    # heard at once, reaches an input callback 20 ms + one block after that.
    device_delay = round((0.03 + 0.02 + 0.08) * RATE)
    speaker = np.zeros(device_delay + len(room), np.float32)  # played so far, oldest first
    indata = np.zeros((1920, 1), np.float32)
    outdata = np.zeros((1920, 1), np.float32)
    mic = []
    worker = threading.Thread(target=loop.run)
    worker.start()
    try:
        start = time.monotonic()
        for k in range(int(6.0 / 0.08)):
            loop.output_callback(outdata, 1920, None, None)
            speaker = np.concatenate([speaker, outdata[:, 0]])
            sounding = speaker[-device_delay - len(room) - 1920 : -device_delay]
            indata[:, 0] = np.convolve(sounding, room, "valid")[1:]
            mic.append(indata[:, 0].copy())
            loop.input_callback(indata, 1920, None, None)
            delay = start + (k + 1) * 0.08 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        loop.stop_event.set()
        worker.join(5)
        loop.close()
    mic_power = np.mean(np.concatenate(mic[-25:]) ** 2)
    heard_power = np.mean(np.concatenate(heard[-25:]) ** 2)
    erle = 10 * np.log10(mic_power / heard_power)
    print(f"\nlive loop ERLE over the last 2 s: {erle:.1f} dB")
    assert loop.stats().extra["echo_offset_moves"] == 0
    assert erle >= 20


def test_a_conversation_takes_the_far_end(tmp_path_factory, voices):
    """An app that plays Moshi itself: `step(mic, far)` hears the mic without the far end's
    echo (`heard`), and the same audio without a canceller reaches the model unchanged."""
    from tiny_moshi import cached_tiny_moshi, load_tiny_model

    files = cached_tiny_moshi(tmp_path_factory)
    model = load_tiny_model(files)
    far = voices[0][: 40 * 1920]
    echo = echo_path.play_through_room(far, echo_path.room_impulse_response(0.3, 0.05, -3.0))
    heard = []
    with model.conversation(seed=1, echo_canceller=EchoCanceller(RATE)) as conversation:
        for k in range(40):
            frame = slice(k * 1920, (k + 1) * 1920)
            result = conversation.step(echo[frame], far=far[frame])
            heard.append(result.heard)
        with pytest.raises(AudioError, match="far end of 1920 samples"):
            conversation.step(echo[:1920], far=far[:100])
    erle = 10 * np.log10(
        np.mean(echo[-1920 * 15 :] ** 2) / np.mean(np.concatenate(heard[-15:]) ** 2)
    )
    assert erle >= 20, erle
    with model.conversation(seed=1) as plain:
        assert plain.step(echo[:1920]).heard is None


def test_denoise_lowers_steady_noise_and_keeps_speech(voices):
    near = voices[1]
    mic = np.zeros(8 * RATE, np.float32)
    mic[RATE : RATE + len(near)] = near
    mic += np.random.default_rng(0).normal(size=len(mic)).astype(np.float32) * 10 ** (-45 / 20)
    silent_far = np.zeros_like(mic)
    plain = EchoCanceller(RATE).process(mic, silent_far)
    denoised = EchoCanceller(RATE, denoise=True).process(mic, silent_far)

    def db(x, seconds):
        return 10 * np.log10(np.mean(x[seconds[0] * RATE : seconds[1] * RATE] ** 2))

    assert db(plain, (7, 8)) - db(denoised, (7, 8)) >= 4  # the noise alone, at the end
    assert abs(db(plain, (2, 5)) - db(denoised, (2, 5))) < 1  # the speech


def test_noise_suppression_alone_keeps_no_far_end(voices):
    """`--denoise --no-echo-cancel`: the model hears the denoised mic; nothing played is kept."""
    heard = []
    loop = LiveLoop(
        lambda pcm: (heard.append(pcm.copy()) or np.zeros(1920, np.float32), ""),
        echo=EchoCanceller(RATE, denoise=True, cancel_echo=False),
    )
    assert loop.played is None and loop.far_end is None
    outdata = np.zeros((1920, 1), np.float32)
    noise = np.random.default_rng(0).normal(size=(30, 1920, 1)).astype(np.float32) * 0.01
    worker = threading.Thread(target=loop.run)
    worker.start()
    try:
        for block in noise:
            loop.output_callback(outdata, 1920, None, None)
            loop.input_callback(block, 1920, None, None)
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while len(heard) < len(noise) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop_event.set()
        worker.join(5)
        loop.close()
    assert len(heard) == len(noise) and "echo_offset_moves" not in loop.stats().extra
    assert np.mean(np.concatenate(heard[-10:]) ** 2) < 0.5 * np.mean(noise[-10:] ** 2)


def test_without_the_package_the_app_says_so_and_goes_on(monkeypatch, capsys):
    import argparse
    import sys

    from moshi_mlx.cli import local

    monkeypatch.setitem(sys.modules, "pywebrtc_audio", None)  # as if not installed
    with pytest.raises(AudioError, match="pip install pywebrtc-audio"):
        EchoCanceller(RATE)
    args = argparse.Namespace(echo_cancel=True, denoise=False)
    assert local._echo_canceller(args) is None
    assert "going on without it: use headphones" in capsys.readouterr().err
    assert local._echo_canceller(argparse.Namespace(echo_cancel=False, denoise=False)) is None
