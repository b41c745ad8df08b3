"""One wait per frame: `TtsRun.step` and `TtsBatch.step` queue the LM step and Mimi's decoding
of its frame together and evaluate them in one `mx.eval`, then read only evaluated arrays."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_moshi import load_tiny_tts
from tiny_tts import TINY_TTS_VOICES

from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import SKIPPED_FRAMES, TtsModel, TtsRequest, TtsRun

ALICE = TINY_TTS_VOICES["alice"]
TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def model(full_mimi_checkpoint) -> TtsModel:
    return load_tiny_tts(full_mimi_checkpoint)


@pytest.fixture
def evals(monkeypatch) -> list[int]:
    """The number of arrays given to each `mx.eval` call."""
    calls: list[int] = []
    evaluate = mx.eval

    def counted(*arrays):
        calls.append(len(arrays))
        return evaluate(*arrays)

    monkeypatch.setattr(mx, "eval", counted)
    return calls


def _audio_steps(model: TtsModel) -> int:
    return model.config.max_delay + model.delay_steps + SKIPPED_FRAMES + 3


def test_a_run_waits_once_per_frame(model, evals):
    run = TtsRun(model, [TtsRequest(TEXT, (ALICE,))], GREEDY, GREEDY, seed=0)
    run.schedules[0].push(model.entries(TEXT))
    run.schedules[0].close()
    played = 0
    for _ in range(_audio_steps(model)):
        evals.clear()
        step = run.step()
        assert len(evals) <= 1  # none before Mimi decodes: the tokens are read, one wait
        if step.pcm[0] is not None:
            assert len(evals) == 1
            played += 1
    assert played == 3


def test_a_batch_waits_once_per_frame(model, evals):
    batch = TtsBatch(model, rows=2, text_sampling=GREEDY, audio_sampling=GREEDY)
    row = batch.add(TtsRequest(TEXT, (ALICE,)))
    batch.close(row)
    played = 0
    for _ in range(_audio_steps(model)):
        evals.clear()
        [out] = batch.step()
        assert len(evals) == 1
        played += out.pcm is not None
    assert played == 3
