"""STT streams joining and leaving one batch (`SttBatch`): each stream's steps (tokens, text,
words, ends of turn, head probabilities), in a batch with streams that started earlier or
later, equal its transcription alone (`SpeechToText`, one stream) on the tiny random STT."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from batch_rows import run_joining
from tiny_moshi import cached_tiny_stt, load_tiny_stt

from moshi_mlx.errors import AudioError, MoshiError
from moshi_mlx.stt.batch import SttBatch
from moshi_mlx.stt.transcriber import SttModel

FRAME = 1920


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> SttModel:
    return load_tiny_stt(cached_tiny_stt(tmp_path_factory))


def _alone(model: SttModel, frames: np.ndarray) -> list[tuple]:
    """Per step after the silence prefix: the stream alone, its audio then the flush."""
    stt = model.speech_to_text()
    silence = np.zeros((stt.flush_steps, FRAME), np.float32)
    steps = [stt.step(frame) for frame in np.concatenate([frames, silence])]
    last = steps[-1]
    steps[-1] = replace(last, events=last.events + stt.finish_stream(0))
    return [_summary(step) for step in steps]


def _summary(step) -> tuple:
    return (
        step.index,
        step.text_token,
        step.text,
        step.events,
        np.round(step.pause_probabilities, 5),
    )


def _same(batched: list[tuple], alone: list[tuple]) -> None:
    assert len(batched) == len(alone)
    for ours, theirs in zip(batched, alone):
        assert ours[:4] == theirs[:4]
        np.testing.assert_allclose(ours[4], theirs[4], atol=1e-4)


def test_streams_joining_and_leaving_a_batch_transcribe_as_alone(model, mimi_signal):
    """Stream 0 starts at step 0, stream 1 at step 4, stream 2 takes stream 0's row when it
    finishes; each pushes its whole audio at once and closes it. (The codec is the tests'
    fastest, rustymimi where installed: each row encodes with a codec of its own.)"""
    audio = [
        mimi_signal(FRAME * frames, seed).reshape(frames, FRAME)
        for frames, seed in ((14, 1), (20, 2), (9, 3))
    ]
    alone = [_alone(model, frames) for frames in audio]
    batch = SttBatch(model, rows=2)

    def start(stream: int) -> int:
        row = batch.add()
        batch.push(row, audio[stream])
        batch.close(row)
        return row

    run = run_joining(batch, start, lambda out: _summary(out.step), second_at=4, limit=1000)
    outputs = run.outputs
    for stream in range(3):
        _same(outputs[stream], alone[stream])
    assert run.third_joined_at > 4  # stream 2 joined a batch under way, in a used row
    texts = [step[2] for steps in outputs.values() for step in steps]
    assert any(texts), "the tiny model wrote no text at all: nothing compared"


def test_rows_and_frames_are_checked(model):
    batch = SttBatch(model, rows=1)
    assert batch.step() == []
    row = batch.add()
    assert batch.waiting == ([row] if model.silence_prefix_steps == 0 else [])
    batch.push(row, np.zeros((2, FRAME), np.float32))
    assert batch.waiting == []
    with pytest.raises(MoshiError, match="all 1 rows"):
        batch.add()
    with pytest.raises(AudioError, match="1920 samples"):
        batch.push(row, np.zeros(100, np.float32))
    batch.remove(row)
    with pytest.raises(MoshiError, match="row 0 holds no stream"):
        batch.push(row, np.zeros(FRAME, np.float32))
