"""`python -m moshi_mlx stt --mic` against a private PulseAudio server: espeak-ng speech into a
virtual microphone, live captions on stdout, compared with the API's on the same samples."""

import math
import signal
import subprocess
import time

import numpy as np
import pytest
from pulse import as_heard, pulseaudio_missing_reason, wait_for_text
from tiny_moshi import cached_tiny_stt, espeak_speech, load_tiny_stt, tiny_moshi_command

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.cli.stt import END_OF_TURN, caption
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.stt.transcriber import SttModel, transcribe
from moshi_mlx.stt.words import finished_words

pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
SPEECH = "Hello. Can you hear me? Tell me about the weather today."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cached_tiny_stt(tmp_path_factory)


def _run_stt(pulse, files, *flags) -> subprocess.CompletedProcess:
    """`python -m moshi_mlx stt` on the tiny STT model to its end under `pulse`."""
    return subprocess.run(
        tiny_moshi_command("moshi_mlx stt", files, *flags),
        env=pulse.env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_list_devices_and_an_unknown_input_device(pulse, files):
    listing = _run_stt(pulse, files, "--list-devices")
    assert listing.returncode == 0, listing.stderr
    assert "idx  in  out  name" in listing.stdout and "pulse" in listing.stdout
    unknown = _run_stt(pulse, files, "--mic", "--input-device", "nosuch")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    # The line `python -m moshi_mlx.local` prints for an unknown device.
    assert unknown.stderr.strip() == (
        "error: no input device name contains 'nosuch'; see --list-devices and pass --input-device"
    )


def _api_captions(model: SttModel, heard: np.ndarray) -> str:
    """The captions of the API's stream over `heard` and the silence after it, for the steps
    `transcribe` takes (the audio's and its flush)."""
    stt = model.speech_to_text()
    steps = math.ceil(len(heard) / FRAME_SIZE) + stt.flush_steps
    padded = np.zeros(steps * FRAME_SIZE, np.float32)
    padded[: len(heard)] = heard
    return "".join(caption(stt.step(frame)) for frame in padded.reshape(steps, FRAME_SIZE))


def test_live_captions_are_the_apis_on_the_same_samples(pulse, files, tmp_path):
    """The virtual mic hands the client exactly the 16-bit samples fed to it, from the first
    one on (its pipe source posts only what is written, and nothing is written before the app
    listens), and the tiny model is deterministic: so the captions equal, character for
    character, the API's on those samples. An offset of a few hundred samples changes the
    random model's text altogether, so this also checks that no audio is lost or shifted."""
    speech_file = espeak_speech(tmp_path / "user.wav", SPEECH)
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    speech = read_audio(speech_file)
    heard = as_heard(speech)
    model = load_tiny_stt(files)
    expected = _api_captions(model, heard)
    words = [word.text for word in finished_words(transcribe(model, [heard])[0])]
    out_path, err_path = tmp_path / "captions.txt", tmp_path / "stderr.txt"
    command = tiny_moshi_command("moshi_mlx stt", files, "--mic", "--input-device", "pulse")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(command, env=pulse.env(), stdout=out, stderr=err)
        try:
            wait_for_text(err_path, "listening (Ctrl-C to stop)", proc, timeout=60)
            pulse.feed_mic(speech)  # real-time paced, then silence
            wait_for_text(out_path, expected, proc, timeout=30 + len(speech) / SAMPLE_RATE)
            interrupted = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=10)
            exit_seconds = time.monotonic() - interrupted
        finally:
            if proc.poll() is None:
                proc.kill()
    captions, err = out_path.read_text(), err_path.read_text()
    print(f"\ncaptions {captions!r}; exit after SIGINT in {exit_seconds:.2f} s")
    assert proc.returncode == 0 and "Traceback" not in err and "interrupted" not in err, err
    assert exit_seconds < 2.0, exit_seconds
    # Printed while running (waited for before Ctrl-C), then a new line at the end.
    assert captions.startswith(expected) and captions.endswith("\n"), (captions, expected)
    # The words `transcribe` gives for the file are read from those same steps' tokens.
    spoken = captions.replace(END_OF_TURN, "").replace(" ", "")
    assert words and "".join(words) in spoken, (words, captions)
