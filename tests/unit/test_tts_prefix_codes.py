"""An audio prefix's codes stay inside the LM's tables: a TTS whose Mimi has more entries per
codebook than its LM's `card` (the tiny TTS of tests/fixtures/tts, card 64, beside a Mimi of
2048) encodes a recording on the first `card` entries, and a prefix with a code outside
0..card-1 is refused (the LM's one gather of every stream's table does not check its rows:
such a code read past the stacked table, and sometimes crashed the process)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.errors import ConfigError, TtsError
from moshi_mlx.models.mimi import Mimi, MimiConfig
from moshi_mlx.runtime.codec import MlxCodec
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tts"
VOICE = FIXTURES / "voices" / "alice.safetensors"


def _wide_mimi(bins: int = 2048) -> Mimi:
    """The tiny Mimi with `bins` random entries per codebook (more than the tiny TTS reads)."""
    config = MimiConfig.tiny()
    config = replace(config, quantizer=replace(config.quantizer, bins=bins))
    mimi = Mimi(config, 8)
    rng = np.random.default_rng(0)
    semantic, acoustic = mimi.quantizer.semantic.codebooks, mimi.quantizer.acoustic.codebooks
    mimi.quantizer.semantic.codebooks = mx.array(rng.normal(size=semantic.shape), mx.float32)
    mimi.quantizer.acoustic.codebooks = mx.array(rng.normal(size=acoustic.shape), mx.float32)
    return mimi


@pytest.fixture(scope="module")
def model() -> TtsModel:
    config = lm_config_of(FIXTURES / "weights.safetensors")
    lm = load_lm(FIXTURES / "weights.safetensors", config, dtype=mx.float32)
    tokenizer = load_tokenizer(FIXTURES / "tokenizer.model")
    return TtsModel(lm, codec=MlxCodec(_wide_mimi()), tokenizer=tokenizer, files=None)


def test_a_recording_encodes_to_codes_the_lm_reads(model):
    t = np.arange(int(1.5 * 24_000)) / 24_000
    sine = (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    wide = model.codec.model
    assert wide.config.quantizer.bins == 2048 and model.config.card == 64
    codes = model.voice_prefix(sine)
    assert codes.shape == (8, 17) and 0 <= codes.min() and codes.max() < model.config.card
    # The cut codec decodes a code as the whole one does (the same entries).
    cut = model.mimi
    assert cut.quantizer.acoustic.codebooks.shape[1] == 64 and wide.with_codebooks(8) is wide
    latent = mx.array(codes.T[None], mx.uint32)
    np.testing.assert_array_equal(
        np.array(cut.quantizer.decode(latent)), np.array(wide.quantizer.decode(latent))
    )
    with pytest.raises(ConfigError, match="not 4096"):
        wide.with_codebooks(8, 4096)


@pytest.mark.parametrize("code", [64, 1984, -1])
def test_a_prefix_with_a_code_outside_the_lms_tables_is_refused(model, code):
    prefix = np.zeros((8, 5), np.int32)
    prefix[3, 2] = code
    with pytest.raises(TtsError, match="codes are 0 to 63 for this model") as caught:
        TtsRun(model, [TtsRequest("Hi.", (VOICE,), prefix=prefix)])
    assert caught.value.parameter == "prefix"
    prefix[3, 2] = 63
    assert TtsRun(model, [TtsRequest("Hi.", (VOICE,), prefix=prefix)]).prefixes.length(0) == 5
