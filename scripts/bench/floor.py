"""The floors a step cannot go under: `--floor`, ms per 7B step at each Apple chip's memory
bandwidth from the published files' manifests; `op_costs_us`, what one operation of each kind
costs to evaluate on this machine's backend at the tiny widths of the `*-structure` shapes."""

from __future__ import annotations

import time
from collections.abc import Callable
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


_WIDTH = 64  # the `*-structure` shapes' width
_CARD = 2049  # an audio codebook's logits (the depformer's output head)


def _op_makers() -> dict[str, Callable[[], Callable[[], mx.array]]]:
    """Per kind (named as `ops_by_primitive` counts it), a maker of one operation of that kind
    on evaluated bf16 inputs shaped as in a one-position step (width 64, 4 heads)."""
    bf16 = mx.bfloat16
    row = mx.random.normal((1, _WIDTH)).astype(bf16)
    square = (mx.random.normal((_WIDTH, _WIDTH)) * 0.1).astype(bf16)
    head = (mx.random.normal((_WIDTH, _CARD)) * 0.1).astype(bf16)
    logits = mx.random.normal((1, _CARD)).astype(bf16)
    keys = mx.random.normal((1, 4, 8, 16)).astype(bf16)
    key = mx.random.normal((1, 4, 1, 16)).astype(bf16)
    table = mx.random.normal((_CARD, _WIDTH)).astype(bf16)
    token = mx.array([7], mx.int32)
    mx.eval(row, square, head, logits, keys, key, table, token)
    fused = mx.compile(lambda x: (x * 1.5 + 0.5).astype(bf16))
    return {
        "Reshape": lambda: row.reshape(1, 4, 1, 16),
        "Transpose": lambda: keys.swapaxes(-1, -2),
        "Split": lambda: mx.split(row, 2, axis=-1)[0],
        "Slice": lambda: logits[:, 5:6],
        "AsType": lambda: row.astype(mx.float32),
        "Add": lambda: row + row,
        "Square": lambda: mx.square(row),
        "Compiled": lambda: fused(row),
        "Sum": lambda: row.sum(axis=-1, keepdims=True),
        "Softmax": lambda: mx.softmax(keys[..., 0], axis=-1, precise=True),
        "Concatenate": lambda: mx.concatenate([keys, key], axis=2),
        "Gather": lambda: table[token],
        "Matmul": lambda: row @ square,
        "Matmul 64x2049": lambda: row @ head,
        "Partition": lambda: mx.partition(logits, kth=_CARD - 250, axis=-1),
        "ArgReduce": lambda: mx.argmax(logits, axis=-1),
    }


def op_costs_us(count: int = 200, repeats: int = 7) -> dict[str, float]:
    """Microseconds per operation of each kind: `count` independent operations of the kind,
    built lazily, then evaluated together (the median of `repeats`, per operation). The
    evaluation is what a compiled step pays per node of its graph (`mx.compile` decides which
    nodes there are, fusing elementwise ones into `Compiled` kernels; evaluating each is the
    same work): the backend's dispatch of one node, plus its arithmetic, next to nothing at
    width 64 but for the matmuls and the sampling's partition."""
    costs = {}
    for kind, make in _op_makers().items():
        mx.eval(make())  # a compiled kernel's first call builds it
        seconds = []
        for _ in range(repeats):
            ops = [make() for _ in range(count)]
            start = time.perf_counter()
            mx.eval(ops)
            seconds.append(time.perf_counter() - start)
        costs[kind] = 1e6 * float(np.median(seconds)) / count
    return costs
