"""The TTS speed plan: its arithmetic, the chip table and its one-line output."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.runtime import speed_plan
from moshi_mlx.runtime.speed_plan import (
    OP_SECONDS,
    SpeedPlan,
    chip_bandwidth,
    frame_bytes,
    frame_ops,
    plan_speed,
)

FIXTURE_CONFIG = Path(__file__).parents[1] / "fixtures" / "tts" / "config.json"


@pytest.fixture(scope="module")
def tts_lm() -> Lm:
    lm = Lm(LmConfig.from_dict(json.loads(FIXTURE_CONFIG.read_text())))
    lm.set_dtype(mx.bfloat16)
    return lm


def test_chip_bandwidths_are_apples_published_figures():
    assert chip_bandwidth("Apple M1") == 68e9
    assert chip_bandwidth("Apple M2 Max") == 400e9
    assert chip_bandwidth("Apple M3 Pro") == 150e9
    assert chip_bandwidth("Apple M4 Pro") == 273e9
    assert chip_bandwidth("Apple M2 Ultra") == 800e9
    assert chip_bandwidth("Intel(R) Core(TM) i9") is None and chip_bandwidth(None) is None


def test_frame_time_is_bytes_over_bandwidth_plus_ops():
    plan = SpeedPlan("Apple M2", 100e9, 3 * 10**9, 10**9, 5000, 32, None)
    assert plan.frame_seconds == pytest.approx(0.04 + 5000 * OP_SECONDS)
    assert plan.real_time_factor == pytest.approx(0.08 / plan.frame_seconds)
    unknown = SpeedPlan(None, None, 1, 1, 1, 32, None)
    assert unknown.real_time_factor is None
    assert unknown.line() == "speed plan: unknown chip (no Apple GPU): no estimate"


def test_frame_reads_each_generated_slice_and_counts_its_ops(tts_lm):
    config = tts_lm.config
    all_weights, others = frame_bytes(tts_lm)
    fewer_weights, same_others = frame_bytes(tts_lm, n_q=config.dep_q - 1)
    last = tts_lm.depformer.slices[config.dep_q - 1]
    table_row = last.emb.weight.nbytes // last.emb.weight.shape[0]
    assert all_weights - fewer_weights == (
        sum(v.nbytes for v in _leaves(last)) - last.emb.weight.nbytes + table_row
    )
    assert others == same_others > 0
    layers = config.num_layers + config.dep_q * config.depformer_num_layers
    assert frame_ops(tts_lm) == speed_plan.OPS_PER_LAYER * layers + speed_plan.OPS_PER_SAMPLE * (
        1 + config.dep_q
    )


def _leaves(module):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(module.parameters())]


def test_one_line_with_the_advice_that_makes_it_real_time(tts_lm, monkeypatch):
    fast = plan_speed(tts_lm, "Apple M2 Ultra")
    assert fast.real_time_factor >= 1 and fast.advice is None
    line = fast.line()
    assert line.startswith("speed plan (an estimate until measured): Apple M2 Ultra, 800 GB/s")
    assert "\n" not in line and "x real time" in line and "real time with" not in line
    # A model too slow at all codebooks but real time at 8 bits alone, or with fewer.
    monkeypatch.setattr(speed_plan, "OP_SECONDS", 0.0)
    weights, others = frame_bytes(tts_lm)
    bandwidth = (weights + others) / 0.08 / 1.2  # 1.2 frames per frame
    monkeypatch.setitem(speed_plan.CHIP_BANDWIDTH_GBS, "M9", bandwidth / 1e9)
    slow = plan_speed(tts_lm, "Apple M9")
    assert slow.real_time_factor == pytest.approx(1 / 1.2)
    assert slow.advice == (tts_lm.config.dep_q, 8) and slow.line().endswith("real time with bits=8")
