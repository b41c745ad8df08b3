"""kyutai/tts-0.75b-en-public's streams (voices cloned from audio prefixes, guided by a null
row each) joining and leaving one `TtsBatch`: each stream's tokens, frames and audio equal its
run alone (`TtsRun`, checked against Kyutai's goldens in tests/parity/test_tts_075_parity.py),
whichever row it takes and whenever it joins (greedy, float32, the tiny random checkpoint of
tests/fixtures/tts_075 and a tiny random Mimi)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_tts import assert_same_stream, steps_alone, tiny_tts_model

from moshi_mlx.errors import TtsError
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.tts.batch import TtsBatch
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts_075"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())["runs"]


@pytest.fixture(scope="module")
def model(tiny_mimi_checkpoint) -> TtsModel:
    return tiny_tts_model(FIXTURES, tiny_mimi_checkpoint, FIXTURES / "config.json")


def _requests() -> list[TtsRequest]:
    """The golden runs' requests: the batch's two (prefixes of 10 and 6 frames), then the
    clone's (12) and the one without a prefix."""
    requests = []
    for name in ("batch", "clone", "no_prefix"):
        golden = GOLDEN[name]
        prefixes = golden["prefixes"] or [None] * len(golden["rows"])
        for row, prefix in zip(golden["rows"], prefixes):
            codes = None if prefix is None else np.array(prefix)[1:]  # row 0 is the text
            requests.append(TtsRequest(row["text"], (), golden["cfg_coef"], codes))
    return requests


def test_cloned_streams_joining_and_leaving_a_batch_speak_as_alone(model):
    """Streams join a batch of 2 rows at steps 0 and 7, and each later one takes the row the
    first stream to end frees (its history, null row, delayed tokens and Mimi state fresh):
    every stream's tokens, frames and audio are those of its run alone."""
    requests = _requests()
    alone = [steps_alone(model, request) for request in requests]
    batch = TtsBatch(model, rows=2, text_sampling=GREEDY, audio_sampling=GREEDY)
    waiting = list(range(len(requests)))
    stream_of: dict[int, int] = {}  # row -> stream
    outputs: dict[int, list] = {stream: [] for stream in waiting}
    for step in range(3000):
        if waiting and batch.free_rows and (step == 0 or step >= 7):
            stream = waiting.pop(0)
            row = batch.add(requests[stream])
            batch.close(row)
            stream_of[row] = stream
        for out in batch.step():
            frame = None if out.frame is None else out.frame.tolist()
            outputs[stream_of[out.row]].append((out.predicted, out.fed, frame, out.pcm))
            if out.finished:
                batch.remove(out.row)
                del stream_of[out.row]
        if not waiting and not stream_of:
            break
    for stream, steps in outputs.items():
        assert_same_stream(steps, alone[stream], atol=1e-5)
    assert all(any(s[3] is not None for s in steps) for steps in outputs.values())


def test_a_batch_takes_one_guidance(model):
    batch = TtsBatch(model, rows=2, text_sampling=GREEDY, audio_sampling=GREEDY)
    batch.add(_requests()[0])
    with pytest.raises(TtsError, match="one cfg_coef"):
        batch.add(TtsRequest("Hi.", (), 1.5, None))
