"""Shared pytest fixtures; each section belongs to one part of the package."""

from pathlib import Path

import numpy as np
import pytest

# Kyutai's published files: every tensor's name, shape and dtype (see manifests/README.md).
MANIFESTS = Path(__file__).parent / "manifests"

# External reference environments (built by scripts/make_reference_envs.sh); tests that
# compare against them skip without them, and say how to build them.
REFERENCE_PYTHON = Path("/opt/venvs/ref/bin/python")  # PyTorch + Kyutai's moshi 0.2.13
KYUTAI_PYTHON = Path("/opt/venvs/kyutai/bin/python")  # Kyutai's moshi_mlx 0.3.0
needs_reference = pytest.mark.skipif(
    not REFERENCE_PYTHON.is_file(),
    reason=f"needs the PyTorch reference environment {REFERENCE_PYTHON.parents[1]}: "
    "build it with scripts/make_reference_envs.sh ref",
)
needs_kyutai = pytest.mark.skipif(
    not KYUTAI_PYTHON.is_file(),
    reason=f"needs Kyutai's moshi_mlx environment {KYUTAI_PYTHON.parents[1]}: "
    "build it with scripts/make_reference_envs.sh kyutai",
)


def needs_rustymimi() -> None:
    """Skip the calling test unless the optional `rustymimi` extra is installed."""
    pytest.importorskip(
        "rustymimi", reason="the optional rustymimi extra: pip install -e '.[rustymimi]'"
    )


# --- LM (models/lm.py): tiny random checkpoints and the PyTorch golden outputs ---------------
LM_FIXTURES = Path(__file__).parent / "fixtures" / "lm"


@pytest.fixture(scope="session")
def tiny_lm_checkpoints(tmp_path_factory):
    """Random tiny-LM files in Kyutai's MLX formats: {"bf16" | "q8" | "q4": Path}."""
    from moshi_mlx.models.lm import LmConfig
    from moshi_mlx.testing.checkpoints import write_random_lm_checkpoint

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

    from moshi_mlx.testing.checkpoints import load_lm

    lm = load_lm(LM_FIXTURES / "weights.safetensors", dtype=mx.float32)
    return lm, dict(np.load(LM_FIXTURES / "golden.npz"))


# --- end of LM section -----------------------------------------------------------------------


# --- Mimi (models/mimi.py, mimi_checkpoint.py, codec.py) -------------------------------------
MIMI_FIXTURES = Path(__file__).parent / "fixtures" / "mimi"
MIMI_MANIFEST = MANIFESTS / "mimi_checkpoint.tsv"


@pytest.fixture(scope="session")
def tiny_mimi_checkpoint(tmp_path_factory):
    """(path, config) of a random tiny Mimi in the published PyTorch layout."""
    from moshi_mlx.models.mimi import MimiConfig
    from moshi_mlx.testing.checkpoints import write_random_mimi_checkpoint

    config = MimiConfig.tiny()
    path = tmp_path_factory.mktemp("mimi") / "tiny_mimi.safetensors"
    return write_random_mimi_checkpoint(path, config, seed=3), config


@pytest.fixture(scope="session")
def full_mimi_checkpoint(tmp_path_factory):
    """A random full-size Mimi (385 MB, the published names and shapes), written once."""
    from moshi_mlx.testing.checkpoints import write_random_mimi_checkpoint

    path = tmp_path_factory.mktemp("mimi_full") / "tokenizer-random.safetensors"
    return write_random_mimi_checkpoint(path, seed=0)


@pytest.fixture(scope="session")
def mimi_signal():
    """signal(samples, seed=0): a modulated two-tone float32 signal with a little noise."""

    def signal(samples: int, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        t = np.arange(samples) / 24000
        tones = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.2 * np.sin(2 * np.pi * 1375 * t)
        noise = 0.05 * rng.normal(size=samples)
        return (tones * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) + noise).astype(np.float32)

    return signal


# --- end of Mimi section ---------------------------------------------------------------------


# --- Audio devices: a private PulseAudio server ------------------------------------------------
@pytest.fixture(scope="module")
def pulse(tmp_path_factory):
    """A private PulseAudio server (tests/helpers/pulse.py) for one test module."""
    from pulse import PulseServer

    with PulseServer(tmp_path_factory.mktemp("pulse")) as server:
        yield server
