"""Operations per step of Moshi's, the STT's and the TTS's compiled steps, as this backend
builds them and in a GPU's form (`scripts/bench --parts ops`, `bench.form.kernel_form`): a
step may not grow past its ceiling. Ceilings are the issue's targets once a step meets them,
until then the count a step had when the ceiling was set."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# (shape, quant) -> {form: most operations per step}; the structure shapes have the published
# models' layers, heads, streams and vocabularies at width 64 (the count is the published one).
CEILINGS = {
    # Moshi 7B: the CPU count in bf16, the GPU's (target 1,200) with a q4 file.
    ("7b-structure", "bf16"): {"cpu": 2051},
    ("7b-structure", "q4"): {"cuda": 1731},
    ("stt-1b-structure", "bf16"): {"cpu": 445, "cuda": 412},  # GPU target: 330
    ("tts-1.6b-structure", "bf16"): {"cpu": 4071, "cuda": 3158},  # GPU: holds
}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    """Each case of `--parts ops` on the ceilings' shapes, by (shape, quant)."""
    tmp = tmp_path_factory.mktemp("ops")
    shapes = ",".join(dict.fromkeys(shape for shape, _ in CEILINGS))
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--parts", "ops", "--shapes", shapes]
    command += ["--quant", "bf16,q4", "--weights-dir", str(tmp / "w"), "--json", str(tmp / "o")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cuda form" in done.stdout
    results = json.loads((tmp / "o").read_text())["results"]
    return {(case["shape"], case["quant"]): case["ours"] for case in results}


@pytest.mark.parametrize("case", list(CEILINGS), ids="-".join)
def test_ops_per_step_within_ceiling(counted, case):
    for form, ceiling in CEILINGS[case].items():
        ops = counted[case][form]["ops"]
        assert ops <= ceiling, f"{case} {form} form: {ops} ops per step, ceiling {ceiling}"


def test_gpu_forms_have_one_kernel_per_norm_and_attention(counted):
    """In a GPU's form each RMSNorm is one kernel; attention is one on Metal, and on CUDA
    where it has no array mask (the depformer's, not the temporal ring's), but none over one
    position (a depformer's first slice: its values); the CPU has none."""
    moshi = counted[("7b-structure", "q4")]
    norms = 32 * 2 + 1 + 8 * 6 * 2  # temporal layers, output norm, 8 slices of 6 layers
    for form in ("cuda", "metal"):
        assert moshi[form]["by_kind"]["RMSNorm"] == norms
    assert moshi["metal"]["by_kind"]["ScaledDotProductAttention"] == 32 + 7 * 6
    assert moshi["cuda"]["by_kind"]["ScaledDotProductAttention"] == 7 * 6
    assert "RMSNorm" not in moshi["cpu"]["by_kind"]
    assert moshi["metal"]["by_kind"]["Quantize"] > 0  # the quantized tables' dequantization
    assert moshi["metal"]["ops"] < moshi["cuda"]["ops"] < moshi["cpu"]["ops"]


def test_kernel_form_restores_the_backend(tmp_path):
    """Outside `kernel_form` MLX's functions and the model's attention choice are its own."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        form = importlib.import_module("bench.form")
    finally:
        sys.path.remove(str(SCRIPTS))
    from moshi_mlx.modules import transformer

    before = (mx.fast.rms_norm, mx.dequantize, transformer.fused_attention)
    with form.kernel_form("metal") as tags:
        assert transformer.fused_attention(True) and set(tags) == set(form.KERNELS)
        x = mx.ones((2, 8))
        assert mx.fast.rms_norm(x, mx.ones((8,)), 1e-5).shape == (2, 8)
    assert (mx.fast.rms_norm, mx.dequantize, transformer.fused_attention) == before
    with pytest.raises(ValueError, match="form"), form.kernel_form("tpu"):
        pass
