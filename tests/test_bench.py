"""Smoke test of scripts/bench.py: the tiny shape, a few steps, sane numbers in the JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MANIFESTS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
STEPS, FRAMES = 6, 3


def _check_timing(stats: dict, count: int) -> None:
    assert stats["n"] == count
    assert 0 < stats["p50"] <= stats["p95"] < 60_000
    assert math.isfinite(stats["mean"]) and stats["mean"] > 0


def _run_bench(flags: str, out: Path, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """Run scripts/bench.py with `flags` (and `--json out`); its output and its JSON report."""
    command = [sys.executable, str(SCRIPTS / "bench.py"), *flags.split(), "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    flags = (
        "--shapes tiny --quant bf16,q4 --parts lm,mimi,pipeline,echo,kv --kv-bits none "
        f"--codec mlx,rustymimi --steps {STEPS} --split-steps 3 --frames {FRAMES} --warmup 1 "
        "--batch-seconds 1"
    )
    done, results = _run_bench(flags, out, timeout=300)
    assert "step_ms" in done.stdout and "real-time factor" in done.stdout  # the printed table
    return results


def _cases(report: dict, part: str) -> list[dict]:
    return [case for case in report["results"] if case["part"] == part]


def test_lm_cases(report):
    cases = _cases(report, "lm")
    assert [(c["shape"], c["quant"]) for c in cases] == [("tiny", "bf16"), ("tiny", "q4")]
    for case in cases:
        ours = case["ours"]
        _check_timing(ours["step_ms"], STEPS)
        for part in ("temporal_ms", "depformer_ms", "sampling_ms"):
            _check_timing(ours[part], 3)
        # Moshi's delays (acoustic codebooks one step late): audio from the second step on.
        assert ours["first_audio_step"] == 1
        assert ours["syncs_per_step"] == 1.0
        assert 0 < ours["graph_ops"]["compiled"] < ours["graph_ops"]["eager"]
        _check_timing(ours["host_ms"], 3)
        assert ours["eval_ms"]["n"] == 3
        assert 0 < ours["peak_memory_gb"] < 2
        assert case["kyutai"] is None


def test_mimi_cases(report):
    cases = {c["ours"]["backend"]: c["ours"] for c in _cases(report, "mimi")}
    assert set(cases) == {"mlx", "rustymimi"}
    for result in cases.values():
        for part in ("encode_ms", "decode_ms", "frame_ms"):
            _check_timing(result[part], FRAMES)
        for part in ("batch_encode_ms", "batch_decode_ms"):  # 1 s of audio, twice
            _check_timing(result[part], 2)
        assert result["real_time_factor"] == pytest.approx(80.0 / result["frame_ms"]["p50"])
    assert cases["mlx"]["peak_memory_gb"] > 0.1  # the full-size codec's float32 weights


def test_pipeline_cases(report):
    cases = _cases(report, "pipeline")
    assert len(cases) == 4  # bf16/q4 x mlx/rustymimi
    for case in cases:
        ours = case["ours"]
        _check_timing(ours["frame_ms"], FRAMES)
        # The first audio frame needs two frames: one step fills the acoustic delay.
        assert ours["first_audio_ms"] >= ours["frame_ms"]["p50"] * 0.5
        assert ours["real_time_factor"] == pytest.approx(80.0 / ours["frame_ms"]["p50"])
        # One host synchronisation per frame with MLX Mimi (encode, LM step, decode evaluated
        # together); rustymimi moves the mic frame and Moshi's codes through the host.
        if ours["backend"] == "mlx":
            assert ours["syncs_per_frame"] == 1.0
        else:
            assert ours["syncs_per_frame"] > 1.0


def test_echo_case(report):
    (case,) = _cases(report, "echo")
    _check_timing(case["ours"]["frame_ms"], 100)  # at least 100 frames of 80 ms
    assert case["ours"]["frame_ms"]["p50"] < 40  # far below real time


def test_bandwidth_floor_from_manifests():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench
    finally:
        sys.path.remove(str(SCRIPTS))
    read = {}
    for quant in ("bf16", "q8", "q4"):
        total, read[quant] = bench.weight_bytes_per_step(MANIFESTS / f"moshiko_mlx_{quant}.tsv")
        # Only the embedding tables' other rows are skipped: about 0.6 GB of 7B bf16.
        assert 0.9 * total < read[quant] < total
    assert read["bf16"] / 1e9 == pytest.approx(14.75, abs=0.01)
    assert read["q4"] / 1e9 == pytest.approx(4.61, abs=0.01)
    assert read["q8"] / 1e9 == pytest.approx(7.84, abs=0.01)
    table = bench.format_floor(MANIFESTS)
    # 4.61 GB at an M1's 68 GB/s: 67.8 ms per step.
    assert "| M1 | 68 |" in table and "67.8" in table


def test_web_server_overhead(tmp_path):
    """The web server's own work per 80 ms frame (Opus both ways, a websocket round trip)."""
    _, report = _run_bench("--parts web --frames 10 --warmup 2", tmp_path / "web.json", 120)
    (case,) = report["results"]
    ours = case["ours"]
    for part in ("decode_ms", "encode_ms", "websocket_ms", "overhead_ms"):
        _check_timing(ours[part], 10)
    assert ours["overhead_ms"]["p50"] >= ours["encode_ms"]["p50"]
    assert 50 < ours["client_bytes_per_frame"] < 2000  # Ogg Opus pages of 80 ms


def test_lm_without_split_steps(tmp_path):
    """`--split-steps 0` measures whole steps only (the parts and the anatomy are skipped)."""
    flags = "--shapes tiny --quant bf16 --parts lm --steps 2 --split-steps 0 --warmup 0"
    _, report = _run_bench(flags, tmp_path / "bench.json", timeout=300)
    ours = report["results"][0]["ours"]
    _check_timing(ours["step_ms"], 2)
    assert ours["temporal_ms"] is None and ours["syncs_per_step"] is None


def test_kv_case(report):
    """The KV part: the tiny LM's ring reserved at its full context, unquantized (its heads
    are too narrow for a quantized cache)."""
    (q4,) = [case for case in _cases(report, "kv") if case["quant"] == "q4"]
    data = q4["ours"]
    assert data["kv"] == "unquantized" and data["ratio"] == 1.0
    _check_timing(data["step_ms"], STEPS)
    assert 0 < data["planned_kv_gb"] < data["peak_memory_gb"]
