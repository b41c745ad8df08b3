"""Full-size golden parity: Kyutai's PyTorch Mimi, run on our random published-layout file.

Needs the reference environment (`/opt/venvs/ref`, torch + Kyutai's `moshi`); skipped without.
`scripts/make_mimi_fixtures.py --full --weights FILE` runs the reference in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from closeness import norm_relative
from conftest import REFERENCE_PYTHON, needs_reference

from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.models.mimi import MimiConfig

pytestmark = needs_reference
SCRIPT = Path(__file__).parents[2] / "scripts" / "make_mimi_fixtures.py"


@pytest.fixture(scope="module")
def reference(full_mimi_checkpoint, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("mimi_reference")
    command = [
        str(REFERENCE_PYTHON),
        str(SCRIPT),
        "--full",
        "--weights",
        str(full_mimi_checkpoint),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return out, dict(np.load(out / "golden.npz"))


def test_full_size_matches_pytorch(full_mimi_checkpoint, reference):
    out, ref = reference
    config = MimiConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert config == MimiConfig.moshi()
    mimi = load_mimi(full_mimi_checkpoint, num_codebooks=8)
    pcm = mx.array(ref["pcm"])

    latent_error = norm_relative(np.array(mimi.encode_latent(pcm)), ref["latent"])
    codes = np.array(mimi.encode(pcm))
    agreement = float((codes == ref["codes"]).mean())
    pcm_error = norm_relative(
        np.array(mimi.decode(mx.array(ref["given_codes"]))), ref["decoded_given"]
    )
    print(
        f"full size vs PyTorch: latent {latent_error:.2e}, pcm {pcm_error:.2e}, "
        f"codes {agreement:.1%}"
    )
    assert latent_error < 1e-4
    assert pcm_error < 1e-4
    assert agreement >= 0.9


def test_beyond_the_attention_context_matches_pytorch(tmp_path):
    """140 frames = 280 transformer steps, past the 250-step window, on the tiny config."""
    command = [str(REFERENCE_PYTHON), str(SCRIPT), "--frames", "140", "--out", str(tmp_path)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    ref = dict(np.load(tmp_path / "golden.npz"))
    config = MimiConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    mimi = load_mimi(tmp_path / "weights.safetensors", num_codebooks=8, config=config)

    latent = np.array(mimi.encode_latent(mx.array(ref["pcm"])))
    assert latent.shape == (1, 32, 140)
    late = slice(126, 140)  # frames whose transformer steps no longer see the start
    assert norm_relative(latent[..., late], ref["latent"][..., late]) < 1e-4
    decoded = np.array(mimi.decode(mx.array(ref["given_codes"])))
    samples = slice(126 * 1920, 140 * 1920)
    assert norm_relative(decoded[..., samples], ref["decoded_given"][..., samples]) < 1e-4
    codes = np.array(mimi.encode(mx.array(ref["pcm"])))
    assert (codes == ref["codes"]).mean() >= 0.95
