"""kyutai/tts-0.75b-en-public's layout against Kyutai's PyTorch TTS (`moshi` 0.2.13
`TTSModel.generate` as `simple_generate` drives it: no condition attributes, an audio prefix,
classifier-free guidance by null rows; fixtures: scripts/make_tts_075_fixtures.py), on a tiny
random checkpoint in the published layout (`text_card_out` 5, no conditioners, no voices),
float32, greedy: every predicted and fed text token, every frame, the end steps, consumption
times and transcripts equal, with and without guidance, with and without a prefix."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.errors import TtsError
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun

FIXTURES = Path(__file__).parents[1] / "fixtures" / "tts_075"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())


def _model(weights: Path) -> TtsModel:
    config = lm_config_of(weights, FIXTURES / "config.json")
    lm = load_lm(weights, config, dtype=mx.float32)
    tokenizer = load_tokenizer(FIXTURES / "tokenizer.model")
    return TtsModel(lm, codec=None, tokenizer=tokenizer, files=None)


@pytest.fixture(scope="module")
def model() -> TtsModel:
    return _model(FIXTURES / "weights.safetensors")


def _run(model: TtsModel, name: str) -> tuple[TtsRun, list[dict]]:
    """Golden run `name` through `TtsRun`: per row its logged tokens and frames."""
    golden = GOLDEN["runs"][name]
    prefixes = golden["prefixes"] or [None] * len(golden["rows"])
    requests = [
        TtsRequest(
            row["text"],
            voices=(),
            cfg_coef=golden["cfg_coef"],
            prefix=None if prefix is None else np.array(prefix)[1:],  # row 0 is the text
        )
        for row, prefix in zip(golden["rows"], prefixes)
    ]
    run = TtsRun(model, requests, GREEDY, GREEDY)
    for request, schedule in zip(requests, run.schedules):
        schedule.push(model.entries(request.text))
        schedule.close()
    rows = [{"logged_text_tokens": [], "frames": []} for _ in requests]
    while not run.finished:
        tokens = run.step_tokens()
        for b, row in enumerate(rows):
            row["logged_text_tokens"].append([tokens.predicted[b], tokens.fed[b]])
            if tokens.frame is not None:
                row["frames"].append(np.array(tokens.frame[b]).tolist())
    return run, rows


@pytest.mark.parametrize("name", list(GOLDEN["runs"]))
def test_greedy_generation_equals_the_reference_step_for_step(model, name):
    golden = GOLDEN["runs"][name]
    run, rows = _run(model, name)
    assert run.step_index == golden["steps"]
    for b, (ours, theirs) in enumerate(zip(rows, golden["rows"])):
        fed = [fed for _, fed in theirs["logged_text_tokens"]]
        assert [f for _, f in ours["logged_text_tokens"]] == fed, b
        assert ours["logged_text_tokens"] == theirs["logged_text_tokens"], b
        assert ours["frames"] == theirs["frames"], b
        schedule = run.schedules[b]
        assert schedule.end_step == theirs["end_step"]
        assert schedule.consumption_times == theirs["consumption_times"]
        assert [list(w) for w in schedule.transcript] == theirs["transcript"]
    guided = golden["cfg_coef"] != 1.0
    assert run.stepper.ring.keys[0].shape[0] == len(rows) * (2 if guided else 1)


def test_the_model_reads_its_own_text_head_and_speaks_without_speaker_tokens(model):
    config = model.config
    assert (config.text_vocab_out, config.direct_guidance, config.cross_attention) == (
        5,
        True,
        False,
    )
    entries = model.entries("Good morning.")
    assert list(entries[0].tokens) == model.tokenizer.encode("Good")  # no speaker token first


def test_the_requests_of_a_guided_batch_take_one_coefficient(model):
    requests = [TtsRequest("Hi.", (), 2.0), TtsRequest("Yes.", (), 1.5)]
    with pytest.raises(TtsError, match=r"one cfg_coef, got \[1.5, 2.0\]"):
        TtsRun(model, requests)
    with pytest.raises(TtsError, match="cfg_coef must be > 0"):
        TtsRun(model, [TtsRequest("Hi.", (), -1.0)])


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_file_loads_strictly_and_clones(model, tmp_path, bits):
    from moshi_mlx.checkpoints.quantize import quantize_checkpoint

    output = tmp_path / f"tts.q{bits}.safetensors"
    quantize_checkpoint(FIXTURES / "weights.safetensors", output, bits, 32, config=model.config)
    quantized = _model(output)
    run, rows = _run(quantized, "clone")
    reference = GOLDEN["runs"]["clone"]["rows"][0]
    assert run.finished and len(rows[0]["frames"]) == len(rows[0]["logged_text_tokens"]) - 2
    prefix_steps = len(GOLDEN["runs"]["clone"]["prefixes"][0][0])
    held = [fed for _, fed in rows[0]["logged_text_tokens"][:prefix_steps]]
    assert held == [fed for _, fed in reference["logged_text_tokens"][:prefix_steps]]
