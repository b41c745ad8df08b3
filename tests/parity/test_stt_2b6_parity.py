"""kyutai/stt-2.6b-en's layout against Kyutai's PyTorch STT path (fixtures:
scripts/make_stt_2b6_fixtures.py): a tiny random model with its 1 s silence prefix, 2.5 s delay
and no pause heads, through `scripts/stt_from_file_pytorch.py`'s loop (13 frames of silence,
the audio, 32 of silence) and its word timing. Our transcription runs on a codec that maps
each PCM frame to the golden's codes, so the prefix, the steps and the words are ours end to end.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import sentencepiece

from moshi_mlx.models.config import LmConfig
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.stt.batch import SttBatch
from moshi_mlx.stt.events import WordEnded, WordStarted
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.testing.checkpoints import load_lm

FIXTURES = Path(__file__).parents[1] / "fixtures" / "stt_2b6"
SUFFIX = 32  # Kyutai's ceil(audio_delay_seconds * 12.5) frames of silence after the audio


class _CodesOfFrames:
    """A codec whose frame k / 1000 (a constant PCM frame) is audio frame k's codes, and
    silence the silence's codes."""

    def __init__(self, silence: np.ndarray, audio: np.ndarray):
        self.table = np.concatenate([silence[None], audio])

    def batch_encoder(self, streams: int):
        return self

    def encode_frames(self, pcm: np.ndarray) -> mx.array:
        return mx.array(self.table[np.rint(np.asarray(pcm)[:, 0] * 1000).astype(int)])

    @property
    def state(self) -> list:
        return []


@pytest.fixture(scope="module")
def golden():
    return np.load(FIXTURES / "golden.npz")


@pytest.fixture(scope="module")
def stt(golden):
    config = LmConfig.from_dict(json.loads((FIXTURES / "config.json").read_text()))
    lm = load_lm(FIXTURES / "weights.safetensors", config, dtype=mx.float32)
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(FIXTURES / "tokenizer.model"))
    codec = _CodesOfFrames(golden["silence_codes"], golden["audio_codes"])
    return SttModel(lm, codec, tokenizer, files=None)


def test_the_published_layout(stt):
    config = stt.lm.config
    assert (
        config.stt_config.audio_delay_seconds,
        config.stt_config.audio_silence_prefix_seconds,
    ) == (
        2.5,
        1.0,
    )
    assert stt.silence_prefix_steps == 13 and not stt.has_pause_heads


def test_text_logits_step_by_step(stt, golden):
    silence, audio = golden["silence_codes"], golden["audio_codes"]
    chunks = [silence] * stt.silence_prefix_steps + list(audio) + [silence] * SUFFIX
    stepper = SttStepper(stt.lm)
    logits = np.stack([np.array(stepper.step(codes[None]).text_logits[0]) for codes in chunks])
    expected = golden["text_logits"]
    error = np.linalg.norm(logits - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert error.max() < 1e-4, error.max()


def test_tokens_and_words_with_the_silence_prefix(stt, golden):
    """Our transcription steps its silence prefix itself; its tokens and timed words are
    Kyutai's (the words' times count from the audio's start: prefix and delay taken off)."""
    transcription = stt.speech_to_text()
    steps = list(transcription.prefix_steps[0])
    frames = len(golden["audio_codes"])
    pcm = [np.full(FRAME_SIZE, k / 1000, np.float32) for k in range(1, frames + 1)]
    pcm += [np.zeros(FRAME_SIZE, np.float32)] * SUFFIX
    steps += [transcription.step(frame) for frame in pcm]
    assert [step.text_token for step in steps] == golden["text_tokens"].tolist()
    events = [event for step in steps for event in step.events]
    events += transcription.finish_stream(0)
    words = []
    for event in events:
        if isinstance(event, WordStarted):
            words.append([event.text, event.start, None])
        elif isinstance(event, WordEnded):
            words[-1][2] = event.end
    expected = json.loads((FIXTURES / "golden_words.json").read_text())
    assert [w[0] for w in words] == [w[0] for w in expected]
    np.testing.assert_allclose([w[1:] for w in words], [w[1:] for w in expected], atol=1e-9)


def test_a_server_batch_serves_it_with_the_same_tokens(stt, golden):
    """`SttBatch` (the server's streams) on a model without pause heads: the prefix fed by the
    batch, the same tokens as alone, no pause probabilities."""
    batch = SttBatch(stt, rows=2)
    row = batch.add()
    batch.push(row, np.stack([np.full(FRAME_SIZE, k / 1000, np.float32) for k in range(1, 11)]))
    tokens = []
    for _ in range(stt.silence_prefix_steps + 10):
        for out in batch.step():
            assert out.step.pause_probabilities == ()
            tokens.append(out.step.text_token)
    assert tokens[-10:] == golden["text_tokens"][13:23].tolist()


def test_vad_refuses_a_model_without_pause_heads(stt, monkeypatch, capsys):
    """`stt --mic --vad` needs the pause heads: one line, exit 2, before the microphone opens."""
    import moshi_mlx.cli.stt as stt_cli

    monkeypatch.setattr(stt_cli, "import_sounddevice", lambda: None)
    monkeypatch.setattr(stt_cli, "resolve_device", lambda device, kind: None)
    monkeypatch.setattr(stt_cli, "_load", lambda args: stt)
    assert stt_cli.main(["--mic", "--vad"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --vad needs an STT model with pause heads, such as kyutai/stt-1b-en_fr-candle; "
        "this model has none\n"
    )
