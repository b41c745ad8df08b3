"""The floors a step cannot go under. `--floor`: where a step's bytes are (weights and KV
cache read per step of each published model, `speed_plan.frame_bytes` of the model built
lazily at its published shape), the time they take at each Apple chip class's bandwidth
(`speed_plan.CHIP_BANDWIDTH_GBS`) and at this machine's (`read_bandwidth`), and whether a
Mac of the class holds real time with the step's operations (Metal's form, counted at the
model's `*-structure` shape) at the speed plan's cost per operation. `op_costs_us`: what one
operation of each kind costs to evaluate on this machine's backend at the tiny widths of the
`*-structure` shapes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import mlx.core as mx
import numpy as np
from bench_stats import FRAME_MS, LM_SHAPES, TTS_SHAPES

from moshi_mlx.checkpoints.lm import quantize_lm
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.runtime.speed_plan import CHIP_BANDWIDTH_GBS, OP_SECONDS, frame_bytes

from .step_ops import step_for, step_ops

# The chip classes of the table, from the slowest memory.
CHIPS = ("M1", "M2", "M3 Pro", "M3 Max", "M2 Max", "M2 Ultra")


@dataclass(frozen=True)
class Published:
    """A published model as the table reads it: its config, the file's bits (None: bf16),
    and the bench shape with its structure at width 64 (where its operations are counted)."""

    name: str
    config: Callable[[], LmConfig]
    bits: int | None
    structure: Callable[[], LmConfig]


def _shape(name: str) -> Callable[[], LmConfig]:
    return lambda: LmConfig.from_dict({**LM_SHAPES, **TTS_SHAPES}[name])


def _structure_widths(config: Callable[[], LmConfig], shape: str) -> Callable[[], LmConfig]:
    """`config` at the widths of the bench shape `shape` (a `*-structure` one)."""
    widths = ("dim", "depformer_dim", "depformer_dim_feedforward")
    return lambda: replace(config(), **{name: LM_SHAPES[shape][name] for name in widths})


PUBLISHED = (
    Published("Moshi 7B q4", LmConfig.moshi_7b, 4, _shape("7b-structure")),
    Published("Moshi 7B q8", LmConfig.moshi_7b, 8, _shape("7b-structure")),
    Published(
        "PersonaPlex 7B q8",
        LmConfig.personaplex_7b,
        8,
        _structure_widths(LmConfig.personaplex_7b, "7b-structure"),
    ),
    Published("Hibiki-Zero 3B q4", _shape("hibiki-zero-3b"), 4, _shape("hibiki-zero-3b-structure")),
    Published("Hibiki-Zero 3B q8", _shape("hibiki-zero-3b"), 8, _shape("hibiki-zero-3b-structure")),
    Published("STT 1B bf16", _shape("stt-1b"), None, _shape("stt-1b-structure")),
    Published("STT 2.6B bf16", _shape("stt-2.6b"), None, _shape("stt-2.6b-structure")),
    Published("STT 2.6B q8", _shape("stt-2.6b"), 8, _shape("stt-2.6b-structure")),
    Published("TTS 1.6B bf16", _shape("tts-1.6b"), None, _shape("tts-1.6b-structure")),
    Published("TTS 1.6B q8", _shape("tts-1.6b"), 8, _shape("tts-1.6b-structure")),
)


def _lazy_lm(config: LmConfig, bits: int | None) -> Lm:
    """`config`'s Lm in bf16, quantized as Kyutai's files are to `bits`: unevaluated, so
    its bytes are known without memory for them."""
    lm = Lm(config)
    lm.set_dtype(mx.bfloat16)
    if bits is not None:
        quantize_lm(lm, bits)
    return lm


def step_bytes(config: LmConfig, bits: int | None) -> tuple[int, int]:
    """(weight bytes, KV cache bytes at full context) one step of `config` reads
    (`speed_plan.frame_bytes` of the lazily built model; the generated codebooks only)."""
    return frame_bytes(_lazy_lm(config, bits), config.moshi_codebooks or None)


def metal_ops(structure: LmConfig, bits: int | None) -> int:
    """Operations of one step in Metal's form (`form.kernel_form`) at `structure`'s shape,
    on random weights (tiny at width 64, evaluated)."""
    lm = _lazy_lm(structure, bits)
    mx.eval(lm.parameters())
    return step_ops(lm, "metal", step_for(lm))["ops"]


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory read bandwidth, bytes/s: a sum over `megabytes` of float32, the
    best of `repeats` with MLX on its default device and with numpy (MLX's CPU backend
    reduces on one thread)."""
    data = mx.ones((megabytes * 2**20 // 4,), mx.float32)
    host = np.ones(data.size, np.float32)
    mx.eval(data)
    best = float("inf")
    for _ in range(repeats):
        for total in (lambda: mx.eval(data.sum()), host.sum):
            start = time.perf_counter()
            total()
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


@cache
def machine_bandwidth() -> float:
    """`read_bandwidth`, measured once per process."""
    return read_bandwidth()


def step_floor(lm: Lm, step_ms: float) -> dict:
    """Where a loaded model's step bytes are on this machine: weights and KV cache (at full
    context) read per step (`speed_plan.frame_bytes`), this machine's bandwidth, the floor
    they imply and the step's ratio to it (`step_ms` over the floor)."""
    weights, kv = frame_bytes(lm, lm.config.moshi_codebooks or None)
    gbs = machine_bandwidth() / 1e9
    floor_ms = (weights + kv) / gbs / 1e6
    return {
        "weights_gb": weights / 1e9,
        "kv_gb": kv / 1e9,
        "machine_gbs": gbs,
        "floor_ms": floor_ms,
        "step_over_floor": step_ms / floor_ms,
    }


def bytes_table(machine_gbs: float | None = None) -> list[dict]:
    """Per published model: GB read per step (weights, KV at full context), its operations
    in Metal's form, and per chip class (and this machine at `machine_gbs`, when given) the
    floor (bytes over bandwidth), the estimate (floor plus operations at
    `speed_plan.OP_SECONDS`) in ms and whether that holds real time (<= 80 ms a step)."""
    rows = []
    bandwidths = {chip: CHIP_BANDWIDTH_GBS[chip] for chip in CHIPS}
    if machine_gbs is not None:
        bandwidths["this machine"] = machine_gbs
    for model in PUBLISHED:
        weights, kv = step_bytes(model.config(), model.bits)
        ops = metal_ops(model.structure(), model.bits)
        row = {"model": model.name, "weights_gb": weights / 1e9, "kv_gb": kv / 1e9, "ops": ops}
        for chip, gbs in bandwidths.items():
            floor_ms = (weights + kv) / gbs / 1e6
            estimate_ms = floor_ms + 1000 * ops * OP_SECONDS
            row[chip] = {
                "gbs": gbs,
                "floor_ms": floor_ms,
                "estimate_ms": estimate_ms,
                "real_time": estimate_ms <= FRAME_MS,
            }
        rows.append(row)
    return rows


def format_floor(machine_gbs: float | None = None) -> str:
    """`bytes_table` as Markdown: per model and chip, floor / estimate ms and real time."""
    rows = bytes_table(machine_gbs)
    chips = [key for key in rows[0] if isinstance(rows[0][key], dict)]
    heads = [f"{chip} {rows[0][chip]['gbs']:.0f} GB/s" for chip in chips]
    lines = [
        "| model | weights GB | KV GB | ops (Metal) | " + " | ".join(heads) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(chips),
    ]
    for row in rows:
        cells = [
            f"{row[c]['floor_ms']:.1f} / {row[c]['estimate_ms']:.1f} "
            + ("yes" if row[c]["real_time"] else "**no**")
            for c in chips
        ]
        head = f"| {row['model']} | {row['weights_gb']:.2f} | {row['kv_gb']:.2f} | {row['ops']} | "
        lines.append(head + " | ".join(cells) + " |")
    lines += [
        "",
        (
            "Per step: the weights read (every matrix once, one row of each embedding table), "
            "the KV cache at full context, and per chip class `floor / estimate ms real-time?`: "
            "the bytes at the bandwidth, then plus the operations at "
            f"{OP_SECONDS * 1e6:.0f} us each (real time: <= {FRAME_MS:.0f} ms a step)."
        ),
    ]
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
