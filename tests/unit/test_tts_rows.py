"""TTS streams joining and leaving one batch (`TtsBatch`): each stream's tokens and audio, in a
batch with others that started earlier or later, equal its run alone (greedy, float32, the
tiny random checkpoint of tests/fixtures/tts and a tiny random Mimi); and the masked history
under them (`KVRing.starts`): a row started at position p attends as a stream at 0."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from batch_rows import run_joining
from tiny_moshi import TINY_TTS
from tiny_tts import TINY_TTS_VOICES, assert_same_stream, steps_alone, tiny_tts_model

from moshi_mlx.errors import TtsError
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun
from moshi_mlx.tts.voices import load_voice, voice_keys_values

FIXTURES = TINY_TTS
VOICES = TINY_TTS_VOICES
RUNS = json.loads((FIXTURES / "golden_generate.json").read_text())["runs"]
TEXTS = [row["text"] for row in RUNS["batch"]["rows"]] + [RUNS["padding_bonus"]["rows"][0]["text"]]


@pytest.fixture(scope="module")
def model(tiny_mimi_checkpoint) -> TtsModel:
    return tiny_tts_model(FIXTURES, tiny_mimi_checkpoint)


def _requests() -> list[TtsRequest]:
    voices = [VOICES["alice"], VOICES["bob"], VOICES["alice"]]
    return [
        TtsRequest(text, (voice,), config)
        for text, voice, config in zip(TEXTS, voices, (2, 1.5, 2))
    ]


def test_streams_joining_and_leaving_a_batch_speak_as_alone(model):
    """Stream 0 starts at step 0, stream 1 at step 5 in the next row, and stream 2 takes
    stream 0's row (its history masked, its delayed tokens and Mimi state fresh) when stream 0
    leaves; every stream's tokens and audio are those of its run alone."""
    requests = _requests()
    alone = [steps_alone(model, request) for request in requests]
    batch = TtsBatch(model, rows=3, text_sampling=GREEDY, audio_sampling=GREEDY)

    def start(stream: int) -> int:
        row = batch.add(requests[stream])
        batch.close(row)
        return row

    def summary(out) -> tuple:
        frame = None if out.frame is None else out.frame.tolist()
        return (out.predicted, out.fed, frame, out.pcm)

    run = run_joining(batch, start, summary, second_at=5, limit=2000)
    outputs = run.outputs
    assert 1 not in run.open_streams  # stream 1 ended first or meanwhile
    for stream in range(3):
        assert_same_stream(outputs[stream], alone[stream], atol=1e-6)
    assert run.third_joined_at > 5  # stream 2 joined a batch well under way, in row 0
    assert all(any(s[3] is not None for s in outputs[k]) for k in range(3))


def test_a_cloned_voices_stream_joining_a_batch_speaks_as_alone(model):
    """A stream with an audio prefix (a cloned voice: "no input" text and its codes forced
    while it lasts, its audio not played) joins a busy batch at step 5 in row 1: its tokens,
    audio and word times are those of its run alone (`TtsRun`), and row 0's are unchanged."""
    codes = np.random.default_rng(3).integers(0, model.config.card, (model.config.dep_q, 12))
    plain, cloned = _requests()[0], replace(_requests()[1], prefix=codes)
    alone = [steps_alone(model, request) for request in (plain, cloned)]
    run = TtsRun(model, [cloned], GREEDY, GREEDY)
    run.schedules[0].push(model.entries(cloned.text))
    run.schedules[0].close()
    while not run.finished:
        run.step_tokens()
    batch = TtsBatch(model, rows=2, text_sampling=GREEDY, audio_sampling=GREEDY)
    outputs: dict[int, list] = {0: [], 1: []}
    words = None
    for step in range(2000):
        if step in (0, 5):
            batch.close(batch.add(plain if step == 0 else cloned))
        for out in batch.step():
            frame = None if out.frame is None else out.frame.tolist()
            outputs[out.row].append((out.predicted, out.fed, frame, out.pcm))
            if out.finished:
                words = batch.words(out.row) if out.row == 1 else words
                batch.remove(out.row)
        if not batch.busy_rows:
            break
    assert_same_stream(outputs[0], alone[0], atol=1e-6)
    assert_same_stream(outputs[1], alone[1], atol=1e-6)
    assert [fed for _, fed, *_ in outputs[1][:12]] == [-1] * 12
    assert words == run.words(0) and words[0][1] >= 0


def test_rows_are_checked(model):
    batch = TtsBatch(model, rows=1, text_sampling=GREEDY, audio_sampling=GREEDY)
    assert batch.step() == []
    row = batch.add(_requests()[0])
    with pytest.raises(TtsError, match="all 1 rows"):
        batch.add(_requests()[1])
    batch.remove(row)
    with pytest.raises(TtsError, match="row 0 holds no stream"):
        batch.push(row, "more")


def test_a_row_started_late_attends_as_a_stream_started_at_zero(model):
    """The temporal transformer, batch of 2: row 1 runs 23 steps of other inputs, then its
    stream starts (`KVRing.with_row_started`) and runs 30 steps, past the attention window:
    its outputs equal the same inputs run alone from position 0 to float rounding."""
    lm = model.lm
    rng = np.random.default_rng(0)
    dim, late, steps = lm.config.dim, 23, 30
    inputs = mx.array(rng.standard_normal((steps, 1, dim)).astype(np.float32))
    noise = mx.array(rng.standard_normal((late + steps, 2, dim)).astype(np.float32))
    voice = load_voice(VOICES["alice"], 16)
    cross_one = voice_keys_values(lm, [[voice]])
    cross_two = voice_keys_values(lm, [[voice], [voice]])
    ring = lm.transformer.make_ring(1, mx.float32)
    alone = []
    for t in range(steps):
        ring = ring.grown(t)
        alone.append(lm.transformer(inputs[t], ring.layers(), cross_one))
        ring = ring.advanced()
        mx.eval(alone[-1], ring.state)
    ring = lm.transformer.make_ring(2, mx.float32)
    batched = []
    for t in range(late + steps):
        if t == late:
            ring = ring.with_row_started(1)
        ring = ring.grown(t)
        x = noise[t] if t < late else mx.concatenate([noise[t][:1], inputs[t - late]])
        out = lm.transformer(x, ring.layers(), cross_two)
        ring = ring.advanced()
        mx.eval(out, ring.state)
        if t >= late:
            batched.append(out[1:])
    assert lm.config.context < steps
    difference = np.abs(np.array(mx.stack(batched)) - np.array(mx.stack(alone))).max()
    print(f"largest difference {difference:.2e}")
    assert difference < 1e-5
