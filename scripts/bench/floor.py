"""`--floor`: ms per 7B step at each Apple chip's memory bandwidth, from the published files'
manifests."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.memory_plan import kv_cache_bytes

# Memory bandwidth specs of Apple chip classes, GB/s (the vendor's published figures).
APPLE_BANDWIDTH_GBS = {
    "M1": 68,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max (30-core GPU)": 300,
    "M3 Max (40-core GPU)": 400,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max (32-core GPU)": 410,
    "M4 Max (40-core GPU)": 546,
    "M1/M2 Ultra": 800,
}
_MANIFEST_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint32": 4}
# Embedding tables are gathered: a step reads one row of each (text, 16 audio, 8 depformer).
_TABLE_PREFIXES = ("text_emb.", "audio_embs.")


def weight_bytes_per_step(manifest: Path) -> tuple[int, int]:
    """(file bytes, weight bytes one LM step reads) from a `moshiko_mlx_*.tsv` manifest.

    Every matrix is read once per step (each depformer slice's own weights once); of the
    embedding tables only the looked-up row (and its scales/biases row) is read.
    """
    total = read = 0
    for line in manifest.read_text().splitlines()[1:]:
        name, shape, dtype = line.split("\t")
        dims = [int(d) for d in shape.split(",")]
        size = int(np.prod(dims)) * _MANIFEST_BYTES[dtype]
        total += size
        is_table = name.startswith(_TABLE_PREFIXES) or ".emb." in name
        read += size // dims[0] if is_table else size
    return total, read


def format_floor(formats_dir: Path) -> str:
    """Markdown table: ms per step at each chip's bandwidth, for the published 7B files."""
    config = LmConfig.moshi_7b()
    kv_full = kv_cache_bytes(config, mx.bfloat16)
    variants = {
        q: weight_bytes_per_step(formats_dir / f"moshiko_mlx_{q}.tsv") for q in ("bf16", "q8", "q4")
    }
    lines = ["| | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    lines.append("| file GB | " + " | ".join(f"{t / 1e9:.2f}" for t, _ in variants.values()) + " |")
    lines.append(
        "| weights read per step, GB | "
        + " | ".join(f"{r / 1e9:.2f}" for _, r in variants.values())
        + " |"
    )
    lines.append(
        f"| + KV cache at {config.context} positions, GB | "
        + " | ".join(f"{(r + kv_full) / 1e9:.2f}" for _, r in variants.values())
        + " |"
    )
    lines += [
        "",
        "| chip | GB/s | " + " | ".join(f"{q} ms (full context)" for q in variants) + " |",
        "|---|---:|" + "---:|" * len(variants),
    ]
    for chip, gbs in APPLE_BANDWIDTH_GBS.items():
        cells = [
            f"{r / gbs / 1e6:.1f} ({(r + kv_full) / gbs / 1e6:.1f})" for _, r in variants.values()
        ]
        lines.append(f"| {chip} | {gbs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
