"""The assistant's own voice must not interrupt it: `python -m moshi_mlx assistant` in an
acoustic loop (PulseAudio's `module-loopback` from the speaker's monitor into the microphone,
60 ms later, as `local`'s echo tests use), greeting a user who says nothing.

The models are those of tests/e2e/test_assistant_e2e.py with one change: the tiny Mimi's decoder
is 25 times louder (`write_short_memory_mimi(..., decoder_gain=25)`), so that the tiny TTS
speaks at about -20 dBFS RMS, espeak-ng's level; the random decoder alone speaks 27 dB
quieter, an echo that even without cancellation the tiny STT would not hear. The tiny STT's
"speech" is any code other than the tiny Mimi's silence codes, and quiet audio encodes to
those: a level gate of the tiny Mimi's quantizer (measured in `moshi_mlx.testing.turn_stt`'s
docstring: no words from about 20 dB under speech level), so AEC3's residual (in this loop,
more than 40 dB down) is silence to it, as it would be to Kyutai's STT. Two runs:

- echo cancellation on (the default): the greeting plays to its end, never cut off, the STT
  hears no turn, and the voice on the mic channel of `--record` is at least 20 dB down;
- `--no-echo-cancel`: the loop brings the voice back into the microphone at about its own
  level, the STT takes it for the user, and the greeting is cut off: the assistant interrupts
  itself, so the first run's pass means something.

The greeting with echo cancellation is kept short (`--max-tokens 20`: 0.9-4.3 s of speech
in 24 runs). The random tiny voice is not speech but mostly a steady 6 kHz tone, and AEC3
stops cancelling a steady tone after about 6 s (0 dB of cancellation from then on; offline,
a 6 kHz sine and this voice replayed do the same, espeak-ng's speech does not): with 30
tokens the greeting lasted 3.8-6.0 s, and when it passed 6 s its last part came back
uncancelled and was heard as the user (1 run in 3 here, and once in CI). Without echo
cancellation the greeting may be long (`--max-tokens 60`): it is cut off within its first
seconds, and a short one could end before the STT's delay lets it hear itself.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from assistant_cli import WORD, running_assistant, wait_for, write_model_flags
from pulse import PulseServer, pulseaudio_missing_reason

pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
VOICE_GAIN = 25.0  # the tiny TTS at espeak-ng's level (see the module docstring)
GREETING_TOKENS = {"on": "20", "off": "60"}  # under AEC3's 6 s limit; long (module docstring)
CUT_OFF = " —[cut off]"
AFTER_SECONDS = 2.0  # listening on after the greeting: the echo of its end, then silence


@pytest.fixture(scope="module")
def pulse_room(tmp_path_factory):
    """A server whose microphone also hears the speaker, 60 ms later: an acoustic loop."""
    with PulseServer(tmp_path_factory.mktemp("pulse_room"), echo_delay_ms=60) as server:
        yield server


@pytest.fixture(scope="module")
def loud_model_flags(tmp_path_factory) -> list[str]:
    return write_model_flags(tmp_path_factory.mktemp("assistant_models"), VOICE_GAIN)


def _greet_in_the_room(pulse, flags, folder: Path, *extra) -> tuple[str, np.ndarray]:
    """The assistant greets in `pulse`'s room until its greeting ends or is cut off, listens
    on for `AFTER_SECONDS`, then gets Ctrl-C; what it printed and its `--record` file."""
    folder.mkdir()
    transcript, stderr_path, record = folder / "said.txt", folder / "err", folder / "both.wav"
    flags = [*flags, *extra, "--transcript", str(transcript), "--record", str(record)]
    with running_assistant(flags, pulse, folder, stderr_path) as proc:
        wait_for(transcript, "\n", proc, wait_for(transcript, "assistant: ", proc))
        time.sleep(AFTER_SECONDS)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    err = stderr_path.read_text()
    assert proc.returncode == 0 and "Traceback" not in err, err
    return out, sf.read(record)[0]


def _level_db(pcm: np.ndarray) -> float:
    """Mean power in dBFS."""
    return float(10 * np.log10(np.mean(pcm**2) + 1e-12))


def test_its_own_voice_does_not_interrupt_it(pulse_room, loud_model_flags, tmp_path):
    runs = {
        name: _greet_in_the_room(pulse_room, loud_model_flags, tmp_path / name, *extra)
        for name, extra in (
            ("on", ["--max-tokens", GREETING_TOKENS["on"]]),
            ("off", ["--no-echo-cancel", "--max-tokens", GREETING_TOKENS["off"]]),
        )
    }
    # the mic channel (after echo cancellation) over the assistant's, over the whole run
    echo = {name: _level_db(both[:, 0]) - _level_db(both[:, 1]) for name, (_, both) in runs.items()}
    for name, (out, both) in runs.items():
        print(f"\necho cancellation {name}: {out!r}; its voice {_level_db(both[:, 1]):.1f} dBFS")
    print(f"the voice on the mic channel, relative to the voice channel: {echo} dB")

    out, both = runs["on"]
    lines = [line for line in out.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("assistant: "), out  # no turn heard
    assert not lines[0].endswith(CUT_OFF) and out.endswith("\n"), out  # played to its end
    voiced = np.abs(both[:, 1]) > 0
    assert _level_db(both[voiced, 1]) > -26  # a voice at speech level
    assert echo["on"] <= -20  # what `local`'s echo tests ask of the canceller

    out, both = runs["off"]
    assert echo["off"] > -10  # the loop brings the voice back at about its own level
    lines = [line for line in out.splitlines() if line]
    assert lines[0].startswith("assistant: ") and lines[0].endswith(CUT_OFF), out
    assert lines[1].startswith(f"you: {WORD}"), out  # its own voice, taken for the user's
