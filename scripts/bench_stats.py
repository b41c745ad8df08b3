"""Shared by `bench.py` (our package) and `bench_kyutai.py` (Kyutai's): shapes and statistics.

Kept free of any `moshi_mlx` import, so both virtual environments can load it.
"""

from __future__ import annotations

import statistics

# LM shapes as Kyutai `config.json` dicts, so both implementations build the same model.
# Every linear input width divides by 64, so q8 (group 64) and q4 (group 32) quantize all layers.
_COMMON = {
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 2048,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": 4224,
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}

LM_SHAPES: dict[str, dict] = {
    # Real vocabularies, small widths: measures per-step overheads (graph building, syncs).
    "tiny": {
        **_COMMON,
        "dim": 256,
        "num_heads": 4,
        "num_layers": 2,
        "depformer_dim": 128,
        "depformer_dim_feedforward": 384,
        "depformer_num_heads": 4,
        "depformer_num_layers": 2,
    },
    # A 1B-class Helium (2048 wide, 16 layers) with the 7B model's depformer.
    "1b": {**_COMMON, "dim": 2048, "num_heads": 16, "num_layers": 16},
    # The published Moshi 7B (v0.1) shape.
    "7b": {**_COMMON, "dim": 4096, "num_heads": 32, "num_layers": 32},
    # 7B's structure (32 temporal layers and heads, 8 depformer slices of 6 layers, real
    # vocabularies) at widths of 64: kernels cost next to nothing, so a step is the host's
    # overhead (graph building, dispatch, syncs). bf16 files only (176-wide FFN hidden layers).
    "7b-structure": {
        **_COMMON,
        "dim": 64,
        "num_heads": 32,
        "num_layers": 32,
        "depformer_dim": 64,
        "depformer_dim_feedforward": 264,
    },
    # Kyutai's stt-1b-en_fr: 16 layers 2048 wide, 32 audio streams in, no depformer, 4
    # voice-activity heads, text 0.5 s behind the audio (tests/fixtures/kyutai_configs).
    "stt-1b": {
        "dim": 2048,
        "num_heads": 16,
        "num_layers": 16,
        "hidden_scale": 4.125,
        "context": 750,
        "max_period": 100000,
        "card": 2048,
        "text_card": 8000,
        "n_q": 32,
        "dep_q": 0,
        "delays": [0] * 33,
        "model_type": "stt",
        "extra_heads_num_heads": 4,
        "stt_config": {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 0.0},
    },
}

QUANT_BITS: dict[str, tuple[int | None, int | None]] = {
    "bf16": (None, None),
    "q8": (8, 64),
    "q4": (4, 32),
    "q4g64": (4, 64),  # a smaller q4 file (`python -m moshi_mlx.quantize --group-size 64`)
}

FRAME_MS = 80.0  # one Mimi frame: 1920 samples at 24 kHz


def summarize(seconds: list[float]) -> dict[str, float]:
    """p50 / p95 / mean in milliseconds of a list of durations in seconds."""
    ms = sorted(s * 1000.0 for s in seconds)
    p95_index = min(len(ms) - 1, round(0.95 * (len(ms) - 1)))
    return {
        "p50": statistics.median(ms),
        "p95": ms[p95_index],
        "mean": statistics.fmean(ms),
        "n": len(ms),
    }


LM_METRICS = ("step_ms", "temporal_ms", "depformer_ms", "sampling_ms", "host_ms", "eval_ms")


def lm_result(samples_s: dict[str, list[float]]) -> dict:
    """Statistics of each LM metric (None for a metric not measured), plus the samples in ms
    (for pooling rounds)."""
    samples_ms = {m: [1000.0 * s for s in samples_s.get(m, [])] for m in LM_METRICS}
    result = {m: summarize(samples_s[m]) if samples_ms[m] else None for m in LM_METRICS}
    result["samples_ms"] = samples_ms
    return result


def pool_rounds(runs: list[dict]) -> dict:
    """One result from several rounds of the same LM case: statistics over all their samples
    (rounds alternate between implementations, so slow spells of a shared machine hit both)."""
    pooled = dict(runs[-1])
    pooled["samples_ms"] = {
        metric: [v for run in runs for v in run["samples_ms"].get(metric, [])]
        for metric in LM_METRICS
    }
    for metric, values in pooled["samples_ms"].items():
        pooled[metric] = summarize([v / 1000.0 for v in values]) if values else None
    pooled["round_step_p50_ms"] = [run["step_ms"]["p50"] for run in runs]
    pooled["peak_memory_gb"] = max(run["peak_memory_gb"] for run in runs)
    return pooled
