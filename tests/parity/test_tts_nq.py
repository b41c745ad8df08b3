"""Fewer codebooks and quantized files, the speed choices of Kyutai's TTS servers: `n_q`
against PyTorch `TTSModel(n_q=6)` (the "n_q" run of scripts/make_tts_fixtures.py), Mimi on
its first codebooks, and files of `moshi_mlx.quantize` loaded by `TtsModel.load` as they
are."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from tiny_moshi import TINY_TTS
from tiny_tts import TINY_TTS_VOICES, load_tiny_tts_lm, run_to_the_end

from moshi_mlx.errors import TtsError
from moshi_mlx.models.mimi import Mimi, MimiConfig
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun

FIXTURES = TINY_TTS
VOICES = TINY_TTS_VOICES


@pytest.fixture(scope="module")
def lm():
    return load_tiny_tts_lm()


def _model(lm, n_q: int | None = None) -> TtsModel:
    tokenizer = load_tokenizer(FIXTURES / "tokenizer.model")
    return TtsModel(lm, codec=None, tokenizer=tokenizer, files=None, n_q=n_q)


def test_fewer_codebooks_equal_the_reference_step_for_step(lm):
    golden = json.loads((FIXTURES / "golden_generate.json").read_text())["runs"]["n_q"]
    n_q = golden["n_q"]
    model = _model(lm, n_q)
    requests = [
        TtsRequest(row["text"], (VOICES[row["voice"]],), row["cfg"]) for row in golden["rows"]
    ]
    run = TtsRun(model, requests, GREEDY, GREEDY)
    for row, schedule in zip(golden["rows"], run.schedules):
        schedule.push(model.entries(row["text"]))
        schedule.close()
    logged, frames = run_to_the_end(run)
    assert run.step_index == golden["steps"]
    for b, row in enumerate(golden["rows"]):
        assert logged[b] == row["logged_text_tokens"]
        assert all((frame[1 + n_q :] == -1).all() for frame in frames[b])  # not generated
        assert [frame[: 1 + n_q].tolist() for frame in frames[b]] == row["frames"]
        assert run.schedules[b].end_step == row["end_step"]


def test_n_q_is_checked(lm):
    with pytest.raises(TtsError, match="1 to 8 audio codebooks, not 9"):
        _model(lm, 9)
    with pytest.raises(TtsError, match="not 0"):
        _model(lm, 0)
    assert _model(lm).codebooks == 8 and _model(lm, 3).codebooks == 3


def test_mimi_on_its_first_codebooks_decodes_as_one_built_with_them():
    config = MimiConfig.moshi()
    mx.random.seed(3)
    full = Mimi(config, 8)
    full.update(
        {
            "quantizer": {
                "acoustic": {"codebooks": mx.random.normal((7, config.quantizer.bins, 256))}
            }
        }
    )
    fewer = full.with_codebooks(5)
    assert fewer.num_codebooks == 5 and full.with_codebooks(8) is full
    assert fewer.quantizer.acoustic.codebooks.shape[0] == 4
    assert fewer.decoder.parameters()["init_conv"]["weight"] is full.decoder.init_conv.weight
    codes = mx.array(np.random.default_rng(0).integers(0, 2048, (1, 8, 2)), mx.uint32)
    latent = fewer.quantizer.decode(codes[:, :5].transpose(0, 2, 1))
    expected = full.quantizer.semantic.decode(codes[:, :1].transpose(0, 2, 1))
    acoustic = full.quantizer.acoustic
    sum_ = sum(acoustic.codebooks[k][codes[:, 1 + k].T] for k in range(4)).transpose(1, 0, 2)
    expected = expected + acoustic.output_proj(sum_)
    np.testing.assert_allclose(np.array(latent), np.array(expected), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="not 9"):
        full.with_codebooks(9)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_files_load_with_no_extra_option(lm, tmp_path, full_mimi_checkpoint, bits):
    """`moshi_mlx.quantize`'s file loads through `TtsModel.load` as it is (its header says
    the bits): the temporal and depformer layers, the voice cross-attention and the
    embeddings quantized (the low-rank tables too where their rank divides by the group
    size, as at tts-1.6b's 128: the bench's `tts_quality` part loads those), and it speaks."""
    from moshi_mlx.checkpoints.quantize import quantize_checkpoint

    path = tmp_path / f"tts.q{bits}.safetensors"
    quantize_checkpoint(FIXTURES / "weights.safetensors", path, bits, 32, config=lm.config)
    model = TtsModel.load(
        moshi_weight=path,
        mimi_weight=full_mimi_checkpoint,
        tokenizer=FIXTURES / "tokenizer.model",
        lm_config=FIXTURES / "config.json",
        dtype=mx.float32,
        n_q=6,
    )
    quantized = _quantized_modules(model.lm)
    for part in ("cross_attention", "self_attn", "depformer.slices", "audio_embs", "text_emb"):
        assert any(part in name for name in quantized), part
    assert {module.bits for module in quantized.values()} == {bits}
    [speech] = model.synthesize([TtsRequest("Hello there.", (VOICES["alice"],))], seed=1)
    assert speech.complete and speech.pcm.size > 0 and speech.audio_codes.shape[0] == 6


def _quantized_modules(module) -> dict:
    from mlx import nn

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return {name: child for name, child in module.named_modules() if isinstance(child, kinds)}


def test_the_command_takes_n_q():
    from moshi_mlx.cli.tts import parse_args

    assert parse_args(["Hello.", "-o", "out.wav", "--n-q", "24"]).n_q == 24
    assert parse_args(["Hello.", "-o", "out.wav"]).n_q is None
