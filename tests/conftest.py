"""Shared pytest fixtures; each section belongs to one part of the package."""

from pathlib import Path

import numpy as np
import pytest

# --- LM (models/lm.py): tiny random checkpoints and the PyTorch golden outputs ---------------
LM_FIXTURES = Path(__file__).parent / "fixtures" / "lm"


@pytest.fixture(scope="session")
def tiny_lm_checkpoints(tmp_path_factory):
    """Random tiny-LM files in Kyutai's MLX formats: {"bf16" | "q8" | "q4": Path}."""
    from moshi_mlx.lm_checkpoint import write_random_lm_checkpoint
    from moshi_mlx.models.lm import LmConfig

    root = tmp_path_factory.mktemp("lm_checkpoints")
    config = LmConfig.tiny()
    return {
        name: write_random_lm_checkpoint(root / name, config, bits=bits, seed=7, write_config=True)
        for name, bits in (("bf16", None), ("q8", 8), ("q4", 4))
    }


@pytest.fixture(scope="session")
def golden_lm():
    """(float32 Lm loaded from the reference fixture weights, dict of golden arrays)."""
    import mlx.core as mx

    from moshi_mlx.lm_checkpoint import load_lm

    lm = load_lm(LM_FIXTURES / "weights.safetensors", dtype=mx.float32)
    return lm, dict(np.load(LM_FIXTURES / "golden.npz"))


# --- end of LM section -----------------------------------------------------------------------
