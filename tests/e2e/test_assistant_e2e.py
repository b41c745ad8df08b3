"""`python -m moshi_mlx assistant` end to end with real (tiny) models through a private
PulseAudio server: espeak-ng speech into a pipe-source microphone, the answer recorded from
the null sink's monitor.

The models, all loaded by the CLI from folders as it loads Kyutai's and mlx-lm's:

- STT: `moshi_mlx.testing.turn_stt.write_turn_taking_stt`. Tiny random weights never detect an
  end of turn (nor recognise a word), so its weights are built: its embeddings tell the codes
  of digital silence from all others, its first attention layer averages "speech" over the
  last second, the pause head 2 says "done" (> 0.6, Unmute's rule) once that second is
  almost all silence and < 0.05 while the user speaks, and its text head writes the one-piece
  word "weather" of the tiny tokenizer, six times a second, while the user speaks (the turn
  logic starts an answer only for a turn with words, and a word interrupts an answer).
- TTS: the random tiny checkpoint of tests/fixtures/tts and its voice "alice".
- LLM: `moshi_mlx.testing.llm.write_tiny_llm`, which rambles in printable ASCII and rarely
  stops by itself: each answer is as long as `--max-tokens`.
- Mimi: a random tiny one (`MimiConfig.tiny()`: 8 codebooks of 64 codes, as the tiny STT and
  TTS take; its config in the file's metadata) whose encoder transformer is turned off
  (`write_short_memory_mimi`), so that silence after speech encodes as the silence before
  it. The full-size random Mimi runs at about half real time on a 2-core CPU, too slow for a
  live conversation.

The conversation: the assistant greets the user (the default) and its greeting plays out; the
user speaks; the pause head ends the turn; the answer's words appear and
its audio reaches the speaker; the user speaks again while the answer plays (a barge-in: the
transcript marks the answer cut off); that turn ends too and a second answer starts; Ctrl-C
ends it with exit code 0, the transcript complete and the `--stats` latency lines printed.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from assistant_cli import WORD, running_assistant, wait_for, write_model_flags
from pulse import pulseaudio_missing_reason
from tiny_moshi import espeak_speech

from moshi_mlx.audio.wav import read_audio

pytestmark = [
    pytest.mark.audio,
    pytest.mark.skipif(
        pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
    ),
]
FIRST = "Hello there. Can you tell me what the weather is like today?"
SECOND = "Wait, stop. Tell me about tomorrow instead."


@pytest.fixture(scope="module")
def model_flags(tmp_path_factory) -> list[str]:
    """The CLI's model flags for the tiny STT, TTS and LLM (see the module docstring)."""
    return write_model_flags(tmp_path_factory.mktemp("assistant_models"))


def _speech(path: Path, text: str) -> np.ndarray:
    made = espeak_speech(path, text)
    if made is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    return read_audio(made)


def _loud_blocks(speaker: Path) -> int:
    """How many 80 ms blocks of a `start_recording` file are not silent."""
    pcm = np.fromfile(speaker, "<i2").astype(np.float32) / 32768
    blocks = pcm[: len(pcm) // 1920 * 1920].reshape(-1, 1920)
    return int((np.abs(blocks).max(axis=1) > 1e-3).sum())


def test_a_conversation_with_a_barge_in(pulse, model_flags, tmp_path):
    first, second = _speech(tmp_path / "first.wav", FIRST), _speech(tmp_path / "second.wav", SECOND)
    transcript, stats_path = tmp_path / "transcript.txt", tmp_path / "stats.json"
    stderr_path, speaker = tmp_path / "stderr.txt", tmp_path / "speaker.raw"
    record = str(tmp_path / "both.wav")
    # --greeting: the default
    flags = [*model_flags, "--max-tokens", "60", "--system", "You are a test."]
    flags += ["--transcript", str(transcript), "--stats", str(stats_path), "--record", record]
    pulse.start_recording(speaker)
    pulse.feed_mic(np.zeros(0, np.float32))  # a live microphone: silence until the user speaks
    with running_assistant(flags, pulse, tmp_path, stderr_path) as proc:
        # the greeting plays out first (its line ends)
        wait_for(transcript, "\n", proc, wait_for(transcript, "assistant: ", proc))
        pulse.feed_mic(first)  # real-time paced, then silence
        # (a) the turn ends by the pause head; the answer's words are played
        heard = wait_for(transcript, f"you: {WORD}", proc)
        answer = wait_for(transcript, "assistant: ", proc, heard)
        wait_for(stderr_path, " ms (detection ", proc)  # its first audio is at the speaker
        # (b) the user speaks over the answer: it stops
        pulse.feed_mic(second)
        cut = wait_for(transcript, " —[cut off]", proc, answer)
        again = wait_for(transcript, f"you: {WORD}", proc, cut)
        second_answer = wait_for(transcript, "assistant: ", proc, again)
        wait_for(transcript, "\n", proc, second_answer)  # played out: its line ends
        # (c) Ctrl-C
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        exit_seconds = time.monotonic() - interrupted
    pulse.stop_recording()
    err = stderr_path.read_text()
    print(f"\n{out}\n{err[err.find('talking:') :]}\nexit after SIGINT in {exit_seconds:.2f} s")
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert exit_seconds < 5.0, exit_seconds  # Ctrl-C ends it at once (1 s unloaded)
    assert transcript.read_text().strip() == out.strip()  # every word printed is in the file

    lines = [line for line in out.splitlines() if line]
    roles = [line.split(":")[0] for line in lines]
    assert roles == ["assistant", "you", "assistant", "you", "assistant"], out
    assert not lines[0].endswith("[cut off]")  # the greeting
    assert lines[1].split(": ")[1].split() == [WORD] * len(lines[1].split()[1:]), out
    assert lines[2].endswith(" —[cut off]") and len(lines[2]) > len("assistant:  —[cut off]")
    assert not lines[4].endswith("[cut off]") and out.endswith("\n")

    # the answers' audio reached the speaker (and the recording's right channel, the user's
    # speech its left); each answer's latency was timed (not the greeting's: no user speech)
    assert _loud_blocks(speaker) >= 5
    both, rate = sf.read(record)
    assert rate == 24000 and both.shape[1] == 2
    assert np.abs(both[:, 0]).max() > 0.1 and np.abs(both[:, 1]).max() > 1e-3
    assert "summary: " in err and "median latency" in err, err
    latency_lines = [line for line in err.splitlines() if " ms (detection " in line]
    assert len(latency_lines) >= 2, err
    for stage in ("detection", "stt_flush", "llm_first_token", "tts_first_audio", "audio_out"):
        assert stage in latency_lines[0]
    answers = json.loads(stats_path.read_text())["answers"]
    assert len(answers["turns"]) >= 2 and answers["median"]["total"] > 0
