"""Kyutai's TTS against its PyTorch reference (`moshi` 0.2.13, `moshi.models.tts`), on the tiny
random checkpoint of scripts/make_tts_fixtures.py in the published layout, float32: the
conditions, the teacher-forced logits past the context, and greedy generation (the text
schedule's decisions, the fed tokens and every frame) for batched multi-word requests."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from closeness import norm_relative
from tiny_moshi import TINY_TTS
from tiny_tts import TINY_TTS_VOICES, load_tiny_tts_lm, run_to_the_end

from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun
from moshi_mlx.tts.voices import VOICE_TENSOR, load_voice, speaker_condition, voice_keys_values

FIXTURES = TINY_TTS
VOICES = TINY_TTS_VOICES


@pytest.fixture(scope="module")
def lm():
    return load_tiny_tts_lm()


@pytest.fixture(scope="module")
def forced():
    return dict(np.load(FIXTURES / "golden_forced.npz"))


def _conditions(lm):
    voices = [[load_voice(VOICES[name], 16)] for name in ("alice", "bob")]
    tensor, mask = speaker_condition(voices)
    condition = lm.condition([{"control": "ok", "cfg": "2.0"}, {"control": "ok", "cfg": "1.5"}])
    return condition, {VOICE_TENSOR: (tensor, mask)}


def test_the_conditions_equal_the_reference(lm, forced):
    condition, tensors = _conditions(lm)
    source = lm.condition_provider.cross_source(tensors)
    assert norm_relative(np.array(condition), forced["sum_cond"][:, 0]) < 1e-6
    assert norm_relative(np.array(source), forced["cross_src"]) < 1e-6


@pytest.mark.parametrize("counts", [(1,), (1, 1), (2, 1), (5,)])
def test_voice_keys_values_equal_the_whole_sources(lm, counts):
    """The empty voice slots' keys and values, kept per model, joined to the filled slots'
    computed per request: those of the whole cross-attended source, bit for bit."""
    alice, bob = (load_voice(VOICES[name], 16) for name in ("alice", "bob"))
    rows = [[(alice, bob)[(row + k) % 2] for k in range(count)] for row, count in enumerate(counts)]
    tensor, mask = speaker_condition(rows)
    whole = lm.cross_keys_values({VOICE_TENSOR: (tensor, mask)})
    joined = voice_keys_values(lm, rows)
    assert len(joined) == len(whole) == lm.config.num_layers
    for pair, reference in zip(joined, whole):
        for ours, theirs in zip(pair, reference):
            assert ours.shape == theirs.shape
            np.testing.assert_array_equal(np.array(ours), np.array(theirs))


def _forced_logits(lm, forced) -> tuple[np.ndarray, np.ndarray]:
    """Text logits (B, T, text_card) and audio logits (B, dep_q, T, card) (NaN where the
    reference masks them) of `lm` teacher-forced on the golden codes, step by step."""
    config = lm.config
    codes, steps = forced["codes"], forced["codes"].shape[-1]
    # The delayed sequence one step longer than the inputs: position t + 1 is what the
    # depformer reads beside the transformer's output at t.
    delayed = np.empty(codes.shape[:2] + (steps + 1,), np.int64)
    for k, delay in enumerate(config.delays):
        for t in range(steps + 1):
            source = t - 1 - delay
            delayed[:, k, t] = config.start_tokens[k] if source < 0 else codes[:, k, source]
    np.testing.assert_array_equal(delayed[..., :steps], forced["input_sequence"])
    condition, tensors = _conditions(lm)
    cross = lm.cross_keys_values(tensors)
    ring = lm.make_ring(batch=2)
    text_logits, audio_logits = [], []
    for t in range(steps):
        ring = ring.grown(t)
        inputs = mx.array(delayed[:, :, t : t + 1], mx.int32)
        out, text = lm.step_text(inputs, ring, condition, cross)
        ring = ring.advanced()
        previous = mx.array(delayed[:, : config.dep_q, t + 1], mx.int32)
        audio = depformer_logits(lm.depformer, out, previous)
        mx.eval(text, audio, ring.keys, ring.values)
        text_logits.append(np.array(text.astype(mx.float32)))
        audio_logits.append(np.array(audio.astype(mx.float32)))
    raw_audio = np.stack(audio_logits, axis=2)  # (B, dep_q, T, card), delayed
    audio = np.full_like(forced["audio_logits"], np.nan)
    for q in range(config.dep_q):
        delay = config.delays[q + 1]
        audio[:, q, : steps - delay] = raw_audio[:, q, delay:]
    return np.stack(text_logits, axis=1), audio


def test_teacher_forced_logits_past_the_context_equal_the_reference(lm, forced):
    assert forced["codes"].shape[-1] > 2 * lm.config.context
    text, audio = _forced_logits(lm, forced)
    assert norm_relative(text, forced["text_logits"]) < 1e-4
    valid = ~np.isnan(forced["audio_logits"])
    np.testing.assert_array_equal(valid, ~np.isnan(audio))
    assert norm_relative(audio[valid], forced["audio_logits"][valid]) < 1e-4


def _model(lm) -> TtsModel:
    files = None  # not loaded from a repo: only what generation uses
    return TtsModel(
        lm, codec=None, tokenizer=load_tokenizer(FIXTURES / "tokenizer.model"), files=files
    )


@pytest.mark.parametrize("run_name", ["batch", "padding_bonus", "long"])
def test_greedy_generation_equals_the_reference_step_for_step(lm, run_name):
    golden = json.loads((FIXTURES / "golden_generate.json").read_text())
    run_golden = golden["runs"][run_name]
    model = _model(lm)
    requests = [
        TtsRequest(row["text"], (VOICES[row["voice"]],), row["cfg"]) for row in run_golden["rows"]
    ]
    run = TtsRun(model, requests, GREEDY, GREEDY, padding_bonus=run_golden["padding_bonus"])
    for row, schedule in zip(run_golden["rows"], run.schedules):
        entries = model.entries(row["text"])
        assert [(list(e.tokens), e.text, e.padding) for e in entries] == [
            (e["tokens"], e["text"], e["padding"]) for e in row["entries"]
        ]
        schedule.push(entries)
        schedule.close()
    logged, frames = run_to_the_end(run)
    assert run.step_index == run_golden["steps"] > 3 * lm.config.context
    for b, row in enumerate(run_golden["rows"]):
        assert logged[b] == row["logged_text_tokens"]
        assert [frame.tolist() for frame in frames[b]] == row["frames"]
        schedule = run.schedules[b]
        assert schedule.end_step == row["end_step"]
        assert schedule.consumption_times == row["consumption_times"]
        assert [list(w) for w in schedule.transcript] == row["transcript"]


@pytest.mark.parametrize(("bits", "tolerance"), [(8, 0.03), (4, 0.25)])
def test_a_quantized_tts_loads_strictly_and_tracks_the_float_model(
    lm, forced, tmp_path, bits, tolerance
):
    from safetensors import safe_open

    from moshi_mlx.checkpoints.quantize import quantize_checkpoint

    output = tmp_path / f"tts.q{bits}.safetensors"
    quantize_checkpoint(FIXTURES / "weights.safetensors", output, bits, 32, config=lm.config)
    with safe_open(str(output), "numpy") as file:
        names = set(file.keys())
    # Kyutai's MLX naming, every depformer slice listed; the two-stream text table quantized.
    slice_7 = "depformer.slices.7.transformer.layers.1.gating.linear_in.scales"
    assert {"text_emb.scales", slice_7} <= names
    quantized = load_lm(output, lm.config, dtype=mx.float32)
    assert quantized.text_emb.quantization == (32, bits, "affine")
    slices = quantized.depformer.slices
    assert slices[5].transformer is slices[4].transformer  # one copy per weight set
    text, audio = _forced_logits(quantized, forced)
    valid = ~np.isnan(forced["audio_logits"])
    errors = (
        norm_relative(text, forced["text_logits"]),
        norm_relative(audio[valid], forced["audio_logits"][valid]),
    )
    print(f"q{bits} relative logit error: text {errors[0]:.4f}, audio {errors[1]:.4f}")
    assert max(errors) < tolerance, errors


def test_the_model_has_kyutais_mlx_names_and_loads_its_mlx_naming(lm, forced, tmp_path):
    from mlx.utils import tree_flatten

    from moshi_mlx.checkpoints.quantize import quantize_checkpoint

    manifest = Path(__file__).parents[1] / "manifests" / "tts_tiny_mlx_names.tsv"
    rows = [line.split("\t") for line in manifest.read_text().splitlines()[1:]]
    kyutai = {name: tuple(int(d) for d in shape.split(",")) for name, shape in rows}
    ours = {name: tuple(p.shape) for name, p in tree_flatten(lm.parameters())}
    assert ours == kyutai
    mlx_named = tmp_path / "tts.safetensors"
    quantize_checkpoint(FIXTURES / "weights.safetensors", mlx_named, 16, config=lm.config)
    reloaded = load_lm(mlx_named, lm.config, dtype=mx.float32)
    text, _ = _forced_logits(reloaded, forced)
    assert norm_relative(text, forced["text_logits"]) < 1e-4
