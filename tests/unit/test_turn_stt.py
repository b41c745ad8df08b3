"""The tiny STT built to take turns (`moshi_mlx.testing.turn_stt`), on its own: it writes words
while a voice-like sound plays and says "done" about a second after it stops."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_moshi import write_tokenizer, write_voice

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.stt.events import WordStarted
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.testing.turn_stt import write_short_memory_mimi, write_turn_taking_stt

WORD = "weather"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> SttModel:
    root = tmp_path_factory.mktemp("turn_stt")
    mimi = write_short_memory_mimi(root / "mimi.safetensors")
    folder = write_turn_taking_stt(root / "stt", mimi, write_tokenizer(root / "tok.model"), WORD)
    return SttModel.load(str(folder))


def test_words_while_the_voice_plays_and_done_a_second_after(model, tmp_path):
    voice = read_audio(write_voice(tmp_path / "voice.wav", seconds=2.0))  # 24 kHz mono
    silence = np.zeros(24000, np.float32)
    pcm = np.concatenate([silence, voice, silence, silence])
    stt = model.speech_to_text()
    steps = [stt.step(frame) for frame in pcm[: len(pcm) // 1920 * 1920].reshape(-1, 1920)]
    done = np.array([step.pause_probabilities[2] for step in steps])
    words = [i for i, s in enumerate(steps) for e in s.events if isinstance(e, WordStarted)]
    assert {e.text for s in steps for e in s.events if isinstance(e, WordStarted)} == {WORD}
    starts, ends = round(12.5), round(12.5 * 3)  # the voice's first and last steps
    assert words and starts <= words[0] and words[-1] <= ends + 13 and len(words) >= 8
    assert done[starts + 6 : ends].max() < 0.05  # speaking: no end of turn, a barge-in
    fired = starts + 6 + int(np.argmax(done[starts + 6 :] > 0.6))
    assert ends + 6 <= fired <= ends + 16, fired  # about a second of silence ends the turn
    assert done[fired:].min() > 0.6


def test_a_word_of_several_pieces_is_refused(tmp_path):
    mimi = write_short_memory_mimi(tmp_path / "mimi.safetensors")
    with pytest.raises(ValueError, match="is not one text token"):
        write_turn_taking_stt(
            tmp_path / "stt", mimi, write_tokenizer(tmp_path / "t.model"), "hello"
        )


def test_a_voice_30_db_down_is_silence(model, tmp_path):
    """The level gate of the tiny Mimi's quantizer (see the module docstring of
    `moshi_mlx.testing.turn_stt`): the same voice 30 dB quieter gives no word and no "speaking"
    from the pause head, as an echo canceller's residual must not."""
    voice = read_audio(write_voice(tmp_path / "voice.wav", seconds=2.0)) * 10 ** (-30 / 20)
    silence = np.zeros(24000, np.float32)
    pcm = np.concatenate([silence, voice, silence])
    stt = model.speech_to_text()
    steps = [stt.step(frame) for frame in pcm[: len(pcm) // 1920 * 1920].reshape(-1, 1920)]
    assert not [e for s in steps for e in s.events if isinstance(e, WordStarted)]
    assert min(step.pause_probabilities[2] for step in steps[13:]) > 0.6
