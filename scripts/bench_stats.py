"""Shared by `bench/` (measuring our package) and `bench_kyutai.py` (Kyutai's): shapes, statistics.

Kept free of any `moshi_mlx` import, so both virtual environments can load it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

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
    # overhead (graph building, dispatch, syncs). A q8/q4 file keeps the 176-wide FFN output
    # layers in bf16 (not a multiple of a group): the same operations, one kind changed.
    "7b-structure": {
        **_COMMON,
        "dim": 64,
        "num_heads": 32,
        "num_layers": 32,
        "depformer_dim": 64,
        "depformer_dim_feedforward": 264,
    },
}

# Kyutai's stt-1b-en_fr as its published config.json (tests/fixtures/kyutai_configs/, every key
# Kyutai's config reader wants): 16 layers 2048 wide, 32 audio streams in, no depformer, 4
# voice-activity heads, text 0.5 s behind the audio.
_CONFIGS = Path(__file__).resolve().parent.parent / "tests/fixtures/kyutai_configs"
PUBLISHED_STT_CONFIG = _CONFIGS / "stt-1b-en_fr-mlx.json"


def _published(path: Path) -> dict:
    """A published config.json without its file names (the bench names its own files)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.endswith("_name")}


# Its 4 voice-activity heads, as the -candle export's config names them (the MLX one's keys
# we have do not: tests/fixtures/kyutai_configs/SOURCES.md).
LM_SHAPES["stt-1b"] = {
    **_published(PUBLISHED_STT_CONFIG),
    "extra_heads_num_heads": 4,
    "extra_heads_dim": 6,
}
# stt-1b's structure (16 layers and heads, 32 streams in, the 4 heads) at width 64: a step is
# its overhead (operations, dispatch, syncs), as `7b-structure`.
LM_SHAPES["stt-1b-structure"] = {**LM_SHAPES["stt-1b"], "dim": 64}
# stt-1b's structure at 128 wide and 2 layers: the `stt` part's tests.
LM_SHAPES["stt-tiny"] = {**LM_SHAPES["stt-1b"], "dim": 128, "num_heads": 4, "num_layers": 2}

# Text-to-speech shapes as Kyutai `config.json` dicts, from the published
# kyutai/tts-1.6b-en_fr config.json (tests/fixtures/kyutai_configs/): 32 audio streams
# all generated (n_q = dep_q), a text stream carrying two tokens per step, summed "control" and
# "cfg" conditions, voices by cross-attention, audio 1.28 s (16 steps) behind the text.
PUBLISHED_TTS_CONFIG = _CONFIGS / "tts-1.6b-en_fr.json"
_TTS_COMMON = _published(PUBLISHED_TTS_CONFIG)

TTS_SHAPES: dict[str, dict] = {
    # The published kyutai/tts-1.6b-en_fr: 16 layers 2048 wide, a depformer of 4 layers 1024
    # wide over 32 codebooks with 11 weight sets.
    "tts-1.6b": _TTS_COMMON,
    # Half as wide and deep (1024 x 8, depformer 512 x 2), the same streams, schedule and
    # delays: a step a CPU takes in well under a second.
    "tts-small": {
        **_TTS_COMMON,
        "dim": 1024,
        "num_heads": 8,
        "num_layers": 8,
        "depformer_dim": 512,
        "depformer_num_heads": 8,
        "depformer_num_layers": 2,
        "depformer_dim_feedforward": 1536,
    },
    # The published structure (16 temporal layers and heads, 32 codebooks over the 11-set
    # schedule, delays, conditioners and voices) with every width 64: kernels cost next to
    # nothing, so a step is its overhead (operations, dispatch, syncs), as `7b-structure`.
    "tts-1.6b-structure": {
        **_TTS_COMMON,
        "dim": 64,
        "depformer_dim": 64,
        "depformer_dim_feedforward": 192,
        "depformer_low_rank_embeddings": 64,
        "conditioners": {
            **_TTS_COMMON["conditioners"],
            "control": {
                **_TTS_COMMON["conditioners"]["control"],
                "lut": {**_TTS_COMMON["conditioners"]["control"]["lut"], "dim": 64},
            },
        },
    },
    # Tests: 64 wide, the real vocabularies and streams, audio 0.32 s (4 steps) behind the
    # text so the first audio comes after a few steps.
    "tts-tiny": {
        **_TTS_COMMON,
        "dim": 64,
        "num_heads": 4,
        "num_layers": 2,
        "depformer_dim": 32,
        "depformer_num_heads": 4,
        "depformer_num_layers": 2,
        "depformer_dim_feedforward": 96,
        "depformer_low_rank_embeddings": 8,
        "tts_config": {"audio_delay": 0.32, "second_stream_ahead": 2},
    },
}

# What the `tts` part speaks: request b of a batch reads TTS_TEXTS[b] (and voice b). Long
# enough that no request ends within a bench's steps (a word takes 2 steps or more).
_TTS_SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Nobody in the village could remember a night when the light had failed.",
    "Rain drummed on the windows while the kettle began to whistle in the kitchen.",
    "She packed two sandwiches, a map of the hills and a small blue notebook.",
    "The train was late again, so the passengers waited under the station clock.",
    "A fox crossed the frozen field and vanished into the dark line of trees.",
    "He tuned the guitar slowly, listening to each string until it rang true.",
    "Tomorrow the market opens early, with fresh bread, cheese and ripe apples.",
    "The children built a raft from driftwood and floated it down the quiet river.",
    "After the storm the whole town came out to clear the branches from the road.",
    "Her grandmother kept every letter in a wooden box beneath the bed.",
    "The museum guide told us the painting had been hidden for forty years.",
]
TTS_TEXTS = [
    " ".join(_TTS_SENTENCES[(start + k) % len(_TTS_SENTENCES)] for k in range(6))
    for start in range(8)
]

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


def tts_result(
    batch: int,
    ttfa_s: float,
    ttfd_s: float,
    first_step: int,
    frame_s: list[float],
    step_s: list[float],
    decode_s: list[float],
    peak_gb: float,
) -> dict:
    """A TTS run of `batch` requests, keys suffixed `_b{batch}`: time to the first audio
    played (`ttfa_ms`, one sample; `first_audio_step`: the steps run when it came) and to the
    first frame Mimi decoded (`ttfd_ms`: earlier where the first frames are cut), and per step
    past it the whole step (`frame_ms`: LM step, text schedule, Mimi decoding, audio on the
    host), its LM part (`step_ms`) and Mimi's (`decode_ms`); the real-time factor (seconds of
    one request's audio per second) and the batch's audio per second, at the median step."""
    frame_p50 = statistics.median(frame_s)
    return {
        f"ttfa_ms_b{batch}": summarize([ttfa_s]),
        f"ttfd_ms_b{batch}": summarize([ttfd_s]),
        f"first_audio_step_b{batch}": first_step,
        f"frame_ms_b{batch}": summarize(frame_s),
        f"step_ms_b{batch}": summarize(step_s),
        f"decode_ms_b{batch}": summarize(decode_s),
        f"real_time_factor_b{batch}": FRAME_MS / 1000 / frame_p50,
        f"audio_per_s_b{batch}": batch * FRAME_MS / 1000 / frame_p50,
        f"peak_memory_gb_b{batch}": peak_gb,
        f"samples_ms_b{batch}": {
            "ttfa": [1000 * ttfa_s],
            "ttfd": [1000 * ttfd_s],
            "frame": [1000 * s for s in frame_s],
            "step": [1000 * s for s in step_s],
            "decode": [1000 * s for s in decode_s],
        },
    }


def pool_tts(runs: list[dict], batches: list[int]) -> dict:
    """One result from rounds of the same TTS case (`tts_result`s of each batch size): every
    statistic over all the rounds' samples (one time to first audio per round)."""
    pooled = dict(runs[-1])
    for batch in batches:
        key = f"samples_ms_b{batch}"
        if any(key not in run for run in runs):
            continue
        samples = {name: [v for run in runs for v in run[key][name]] for name in runs[0][key]}
        pooled[key] = samples
        for name, values in samples.items():
            pooled[f"{name}_ms_b{batch}"] = summarize([v / 1000 for v in values])
        frame_s = pooled[f"frame_ms_b{batch}"]["p50"] / 1000
        pooled[f"real_time_factor_b{batch}"] = FRAME_MS / 1000 / frame_s
        pooled[f"audio_per_s_b{batch}"] = batch * FRAME_MS / 1000 / frame_s
        pooled[f"peak_memory_gb_b{batch}"] = max(run[f"peak_memory_gb_b{batch}"] for run in runs)
    peaks = [
        pooled[f"peak_memory_gb_b{batch}"] for batch in batches if f"error_b{batch}" not in pooled
    ]
    pooled["peak_memory_gb"] = max(peaks, default=None)
    return pooled
