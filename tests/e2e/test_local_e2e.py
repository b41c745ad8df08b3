"""`python -m moshi_mlx.local` against a private PulseAudio server: espeak-ng speech into a
virtual microphone, Moshi's audio recorded from the null sink's monitor."""

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from pulse import PulseServer, pulseaudio_missing_reason, wait_for_text
from tiny_moshi import (
    cached_tiny_hibiki,
    cached_tiny_moshi,
    cached_tiny_personaplex,
    espeak_speech,
    fast_codec,
    weight_flags,
)

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.chat.persona.cache import CACHE_ENV

pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
BLOCKS_PER_SECOND = 24000 / 1920  # 12.5
RUN_SECONDS = 6.0
ROOM_SECONDS = 5.0  # Moshi talking alone after the user's speech, in the echo test
DEVICES = ["--input-device", "pulse", "--output-device", "pulse"]


def _local(pulse, *args, env: dict | None = None, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "moshi_mlx.local", *map(str, args)],
        env={**pulse.env(), **(env or {})},
        **kwargs,
    )


@contextlib.contextmanager
def _started(pulse, stderr_path: Path, ready: str, *args, env: dict | None = None, **kwargs):
    """`python -m moshi_mlx.local ARGS` under `pulse`, its stderr written to `stderr_path`,
    once that says `ready`; the process is killed on the way out if it still runs."""
    with open(stderr_path, "w") as stderr:
        proc = _local(pulse, *args, env=env, stderr=stderr, **kwargs)
        try:
            wait_for_text(stderr_path, ready, proc, timeout=90)
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def _run_local(
    pulse, *args, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python -m moshi_mlx.local ARGS` to its end under `pulse`, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "moshi_mlx.local", *map(str, args)],
        env={**pulse.env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_list_and_pick_devices(pulse):
    listing = _run_local(pulse, "--list-devices", timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "pulse" in listing.stdout and "idx  in  out  name" in listing.stdout
    bad = _run_local(pulse, "--input-device", "no-such-mic", timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "error: no input device name contains 'no-such-mic'; see --list-devices and pass "
        "--input-device"
    )


def test_conversation_through_pulseaudio(pulse, tmp_path, tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    speech_file = espeak_speech(
        tmp_path / "user.wav", "Hello Moshi. Can you hear me? Tell me about the weather today."
    )
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    speech = read_audio(speech_file)
    stderr_path, stats_path = tmp_path / "stderr.txt", tmp_path / "stats.json"
    record, transcript = tmp_path / "both.wav", tmp_path / "moshi.txt"
    pulse.start_recording(tmp_path / "speaker.raw")
    with _started(
        pulse,
        stderr_path,
        "Ctrl-C to stop",
        *weight_flags(files),
        "--seed",
        1,
        *DEVICES,
        "--record",
        record,
        "--transcript",
        transcript,
        "--stats",
        stats_path,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        pulse.feed_mic(speech)  # real-time paced, then silence
        time.sleep(RUN_SECONDS)
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
        exit_seconds = time.monotonic() - interrupted
    pulse.stop_recording()
    err = stderr_path.read_text()

    # Ctrl-C: clean exit within a second, summary printed
    assert proc.returncode == 0, err
    assert exit_seconds < 1.0, exit_seconds
    assert "Traceback" not in err and "summary:" in err
    print(f"\nexit after SIGINT in {exit_seconds:.2f} s; {err.split('summary: ')[-1]}")

    # Callbacks at the real-time cadence
    stats = json.loads(stats_path.read_text())
    for side in ("input", "output"):
        times = np.array(stats[f"{side}_times"])
        span = times[-1] - times[0]
        assert span > RUN_SECONDS - 1, (side, span)
        steady = times[times > times[0] + 1.0]  # skip start-up buffer filling
        rate = (len(steady) - 1) / (steady[-1] - steady[0])
        assert abs(rate - BLOCKS_PER_SECOND) < 0.5, (side, rate)
    assert stats["mic_overflows"] == 0, stats["mic_overflows"]

    # On this CPU the full-size random Mimi is slower than real time: lag is reported and
    # handled by dropping old mic frames, so latency stays bounded instead of growing.
    if stats["step_ms_mean"] > 100:
        assert stats["dropped_frames"] > 0 and "lag: the model is slower than real time" in err
    elif stats["step_ms_mean"] < 60:  # a fast machine keeps up
        assert stats["dropped_frames"] == 0
    assert "(median, last 5 s)" in err, err  # the live latency line
    # No drift: no mic frame waits for the model longer than --max-lag (3 frames) plus a
    # block and some scheduling jitter, whatever the step time.
    assert stats["mic_wait_ms_max"] < (3 + 1) * 80 + 150, stats["mic_wait_ms_max"]
    latencies = np.array(stats["latencies_ms"])
    assert len(latencies) >= 5, latencies
    bound = (
        stats["mic_wait_ms_max"]
        + stats["step_ms_max"]
        + 80
        + 150
        + 1000 * stats["latency_output_device_s"]
    )
    assert latencies.max() < bound, (latencies, bound)

    # Moshi's audio reached the speaker: the null sink's monitor is not silent
    loud_blocks = _loud_blocks(tmp_path / "speaker.raw")
    assert loud_blocks >= 3, loud_blocks

    # Recording: 2 channels, the user's speech on the left, Moshi on the right
    both, rate = sf.read(record)
    assert rate == 24000 and both.ndim == 2 and both.shape[1] == 2
    assert len(both) >= 0.8 * stats["input_callbacks"] * 1920
    assert np.abs(both[:, 0]).max() > 0.1 and np.abs(both[:, 1]).max() > 1e-3, both.shape
    # Transcript: the text printed live, saved to the file
    assert transcript.read_text().strip() == out.strip()


def _loud_blocks(speaker: Path) -> int:
    """How many 80 ms blocks of a `start_recording` file are not silent."""
    pcm = np.fromfile(speaker, "<i2").astype(np.float32) / 32768
    blocks = pcm[: len(pcm) // 1920 * 1920].reshape(-1, 1920)
    return int((np.abs(blocks).max(axis=1) > 1e-3).sum())


def test_hibiki_translates_french_speech_with_guidance(pulse, tmp_path, tmp_path_factory):
    """A tiny random Hibiki, guided (--cfg-coef 3: the conditioned and the null row step as a
    batch of 2), hears French speech through the mic and speaks on the speaker; its text is
    printed and saved."""
    files = cached_tiny_hibiki(tmp_path_factory)
    speech_file = espeak_speech(
        tmp_path / "user.wav", "Bonjour. Je voudrais un café, s'il vous plaît.", voice="fr"
    )
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    speech = read_audio(speech_file)
    stderr_path, transcript = tmp_path / "stderr.txt", tmp_path / "hibiki.txt"
    pulse.start_recording(tmp_path / "speaker.raw")
    with _started(
        pulse,
        stderr_path,
        "-> Hibiki -> speaker",
        *weight_flags(files),
        "--codec",
        fast_codec(),
        *DEVICES,
        "--seed",
        1,
        "--cfg-coef",
        3.0,
        "--transcript",
        transcript,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        pulse.feed_mic(speech)  # real-time paced, then silence
        time.sleep(len(speech) / 24000 + 2.0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    pulse.stop_recording()
    err = stderr_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in err and "summary:" in err, err
    loud_blocks = _loud_blocks(tmp_path / "speaker.raw")
    assert loud_blocks >= 3, loud_blocks
    assert out.strip() and transcript.read_text().strip() == out.strip(), out


def test_guidance_on_a_model_without_conditions_is_one_line_with_exit_code_2(
    pulse, tmp_path_factory
):
    """Moshi takes no condition, so --cfg-coef other than 1 is refused (once the model is
    loaded: its generator checks it)."""
    moshi = weight_flags(cached_tiny_moshi(tmp_path_factory))
    done = _run_local(pulse, *moshi, "--codec", fast_codec(), *DEVICES, "--cfg-coef", 3)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    error = "error: this model takes no condition, so no guidance (cfg_coef 1)"
    assert lines == [error], done.stderr


def test_a_load_error_is_one_line_with_exit_code_2(pulse, tmp_path):
    done = _run_local(
        pulse,
        "--moshi-weight",
        tmp_path / "none.safetensors",
        "--input-device",
        "pulse",
        "--output-device",
        "pulse",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "none.safetensors" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_persona_prompt_before_the_audio_starts(pulse, tmp_path, tmp_path_factory):
    """PersonaPlex: the prompt of --voice and --role is computed (and said so) before the
    streams start; a Moshi model refuses both in one line."""
    files = cached_tiny_personaplex(tmp_path_factory)
    stderr_path = tmp_path / "stderr.txt"
    with _started(
        pulse,
        stderr_path,
        "Ctrl-C to stop",
        *weight_flags(files),
        "--codec",
        fast_codec(),
        *DEVICES,
        "--voice",
        "NATM1",
        "--role",
        "You are a tutor.",
        env={CACHE_ENV: str(tmp_path / "prompts")},
        stdout=subprocess.DEVNULL,
    ) as proc:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    err = stderr_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in err, err
    prompt = err.index("[moshi_mlx.chat.persona] prompt (voice NATM1, role of")
    assert prompt < err.index("talking: mic"), err

    moshi = cached_tiny_moshi(tmp_path_factory)
    done = _run_local(pulse, *weight_flags(moshi), *DEVICES, "--voice", "NATF2")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "this model is Moshi" in lines[0], done.stderr


def test_kill_9_leaves_a_readable_recording_and_transcript(pulse, tmp_path, tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    speech_file = espeak_speech(tmp_path / "user.wav", "Hello Moshi. Are you still there?")
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    record, transcript = tmp_path / "both.wav", tmp_path / "moshi.txt"
    record.write_bytes(b"made by the user")
    stderr_path = tmp_path / "stderr.txt"
    refused = _run_local(pulse, *weight_flags(files), "--record", record)
    assert refused.returncode == 2 and "already exists" in refused.stderr, refused.stderr
    assert record.read_bytes() == b"made by the user"  # never overwritten
    missing = tmp_path / "missing" / "transcript.txt"
    refused = _run_local(pulse, *weight_flags(files), "--transcript", missing)
    assert refused.returncode == 2 and "does not exist" in refused.stderr, refused.stderr
    assert "loading" not in refused.stderr.lower()  # refused before the model loads
    record.unlink()
    with _started(
        pulse,
        stderr_path,
        "Ctrl-C to stop",
        *weight_flags(files),
        "--seed",
        2,
        *DEVICES,
        "--record",
        record,
        "--transcript",
        transcript,
        stdout=subprocess.PIPE,
    ) as proc:
        talking = time.monotonic()
        pulse.feed_mic(read_audio(speech_file))
        time.sleep(3.5)
        proc.kill()  # SIGKILL: no handler, no close, no flush
        ran = time.monotonic() - talking
        out = proc.stdout.read().decode()
        proc.wait(10)
    both, rate = sf.read(record)
    assert rate == 24000 and both.shape[1] == 2
    # everything up to the last whole second of the conversation is there
    assert len(both) >= (ran - 1.5) * 24000, (len(both) / 24000, ran)
    assert np.abs(both[:, 0]).max() > 0.05
    assert transcript.read_text(encoding="utf-8") == out  # each piece flushed as printed


@pytest.fixture(scope="module")
def pulse_room(tmp_path_factory):
    """A server whose microphone also hears the speaker, 60 ms later: an acoustic loop."""
    with PulseServer(tmp_path_factory.mktemp("pulse_room"), echo_delay_ms=60) as server:
        yield server


def _talk_in_the_room(pulse, files, folder, speech, *flags) -> tuple[np.ndarray, dict]:
    """Run the app in `pulse`'s room while `speech` is said; its --record and --stats."""
    folder.mkdir()
    record, stats_path, stderr_path = folder / "both.wav", folder / "s.json", folder / "err"
    with _started(
        pulse,
        stderr_path,
        "Ctrl-C to stop",
        *weight_flags(files),
        "--codec",
        fast_codec(),
        "--seed",
        3,
        *DEVICES,
        "--record",
        record,
        "--stats",
        stats_path,
        *flags,
        stdout=subprocess.DEVNULL,
    ) as proc:
        pulse.feed_mic(speech)
        time.sleep(len(speech) / 24000 + ROOM_SECONDS)
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
    assert proc.returncode == 0, stderr_path.read_text()
    return sf.read(record)[0], json.loads(stats_path.read_text())


def _echo_level_db(both: np.ndarray, start: int) -> float:
    """Power of the user channel over Moshi's channel, from sample `start` (the user quiet)."""
    user, moshi = both[start:, 0], both[start:, 1]
    return float(10 * np.log10(np.mean(user**2) / np.mean(moshi**2)))


def test_echo_cancellation_in_an_acoustic_loop(pulse_room, tmp_path, tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    speech_file = espeak_speech(
        tmp_path / "user.wav", "Hello Moshi. I am talking to you through my laptop speakers."
    )
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    speech = read_audio(speech_file)
    runs = {}
    for name, flags in (("off", ["--no-echo-cancel"]), ("on", [])):
        runs[name] = _talk_in_the_room(pulse_room, files, tmp_path / name, speech, *flags)
    quiet_from = int(len(speech) + 1.5 * 24000)  # the user has finished by then
    levels = {name: _echo_level_db(both, quiet_from) for name, (both, _) in runs.items()}
    print(f"\nMoshi's voice on the user channel: {levels} dB (relative to Moshi's channel)")
    assert runs["on"][1]["echo_cancel"] and not runs["off"][1]["echo_cancel"]
    assert levels["off"] > -10  # the loop really brings Moshi back into the microphone
    assert levels["off"] - levels["on"] >= 20
    # the user's speech is still there with the canceller on, at its own level
    heard = runs["on"][0][:quiet_from, 0]
    speech_db = 10 * np.log10(np.mean(heard**2) / np.mean(speech**2) * len(heard) / len(speech))
    print(f"the user's speech on the user channel: {speech_db:+.1f} dB")
    assert abs(speech_db) < 6


def _busy_cpu_loops(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes spinning a CPU each, for at most `seconds`."""
    spin = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(["timeout", str(seconds), *spin]) for _ in range(count)]


def test_echo_cancellation_with_busy_cpu_loops(pulse_room, tmp_path, tmp_path_factory):
    """Two CPU-bound processes beside the app (on this 2-core machine, more load than it has
    cores): stalled callbacks, output stalls and dropped frames must not cost the canceller
    its alignment. With echo cancellation off the loop brings Moshi back at about 0 dB
    (`test_echo_cancellation_in_an_acoustic_loop`), so -20 dB here is a 20 dB reduction."""
    files = cached_tiny_moshi(tmp_path_factory)
    speech_file = espeak_speech(
        tmp_path / "user.wav", "Hello Moshi. I am talking to you through my laptop speakers."
    )
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    speech = read_audio(speech_file)
    loops = _busy_cpu_loops(2, 150)
    try:
        both, stats = _talk_in_the_room(pulse_room, files, tmp_path / "busy", speech)
    finally:
        for loop in loops:
            loop.terminate()  # timeout passes the signal on to its child
            loop.wait(5)
    quiet_from = int(len(speech) + 1.5 * 24000)
    level = _echo_level_db(both, quiet_from)
    print(
        f"\nbusy CPU: Moshi's voice on the user channel {level:.1f} dB; offset moves "
        f"{stats['echo_offset_moves']}, output gaps {stats['echo_output_gaps']}, input gaps "
        f"{stats['echo_input_gaps']}, {stats['dropped_frames']} frames dropped for lag"
    )
    assert stats["echo_cancel"]
    assert level <= -20
