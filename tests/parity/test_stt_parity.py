"""Kyutai's STT layout against PyTorch moshi 0.2.13 (fixtures: scripts/make_stt_fixtures.py).

A tiny random model in the published STT layout (32 audio streams, no depformer, 4
voice-activity heads), loaded from its PyTorch-named file, steps through the same 101
`LMGen.step_with_extra_heads` calls as the reference: text logits within 1e-4 relative,
greedy text tokens and head probabilities equal.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.models.config import LmConfig
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.testing.checkpoints import load_lm

FIXTURES = Path(__file__).parents[1] / "fixtures" / "stt"


@pytest.mark.parametrize("variant", ["", "_delayed"])
def test_steps_match_pytorch_lmgen(variant):
    config = LmConfig.from_dict(json.loads((FIXTURES / f"config{variant}.json").read_text()))
    golden = np.load(FIXTURES / f"golden{variant}.npz")
    lm = load_lm(FIXTURES / "weights.safetensors", config, dtype=mx.float32)
    assert lm.config.extra_heads_num_heads == 4
    stepper = SttStepper(lm)
    texts, logits, heads = [], [], []
    for codes in golden["call_codes"]:
        out = stepper.step(codes[None])
        texts.append(out.text.item() if stepper.ready else -1)
        logits.append(np.array(out.text_logits[0]))
        heads.append(np.array(out.head_probabilities[0]))
    logits, expected = np.stack(logits), golden["text_logits"]
    error = np.linalg.norm(logits - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert error.max() < 1e-4, error.max()
    assert texts == golden["text_tokens"].tolist()
    returned = ~np.isnan(golden["extra_heads"][:, 0, 0])
    np.testing.assert_allclose(
        np.stack(heads)[returned], golden["extra_heads"][returned], atol=1e-5
    )
    print(f"\nSTT{variant}: text logits max rel error {error.max():.1e} over {len(texts)} steps")


def test_parameter_names_are_kyutais_mlx_names():
    """Kyutai's MLX STT files (the -mlx repos) load by name: our parameters are theirs."""
    from mlx.utils import tree_flatten

    from moshi_mlx.models.lm import Lm

    config = LmConfig.from_dict(json.loads((FIXTURES / "config.json").read_text()))
    manifest = Path(__file__).parents[1] / "manifests" / "stt_tiny_mlx_names.tsv"
    rows = [line.split("\t") for line in manifest.read_text().splitlines()[1:] if line]
    theirs = {name: tuple(int(n) for n in shape.split(",")) for name, shape in rows}
    ours = {name: tuple(p.shape) for name, p in tree_flatten(Lm(config).parameters())}
    assert ours == theirs
