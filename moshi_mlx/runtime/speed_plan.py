"""The expected speed of a TTS frame on this device's chip class: an estimate until measured.

A frame is one temporal step and one depformer slice per generated codebook. On an Apple GPU
its time is about what it reads over the memory bandwidth (`frame_bytes`: every matrix of
the temporal transformer once, each generated slice's own weights once, one row of each
embedding table, the voices' cross-attention keys and values and the KV cache at full
context) plus a fixed cost per operation of the compiled step (`frame_ops`: the bench's
count at the tts-1.6b structure, `scripts/bench --parts tts`, per layer and per sample).
`SpeedPlan.real_time_factor` is audio seconds per second; `advice` finds the fewest changes
(8 bits, fewer codebooks) that make it real time. Bandwidths are Apple's published figures
per chip class; an unknown chip gets no estimate.
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from moshi_mlx.models.lm import Lm

FRAME_SECONDS = 0.08
# Apple's published memory bandwidth per chip class, GB/s (binned Max chips: the lower).
CHIP_BANDWIDTH_GBS = {
    "M1": 68,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M1 Ultra": 800,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M2 Ultra": 800,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max": 300,
    "M3 Ultra": 800,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max": 410,
}
# Operations of the compiled TTS step (bench, tts-1.6b-structure, MLX's CPU backend where the
# mx.fast kernels count as their decomposition: an upper bound for Metal).
OPS_PER_LAYER = 33
OPS_PER_SAMPLE = 6
OP_SECONDS = 6e-6  # assumed cost of one operation on an Apple GPU (launch and dispatch)
Q8_BYTES_PER_WEIGHT = 8.5 / 8  # 8 bits plus a 16-bit scale and bias per group of 64


def chip_name() -> str | None:
    """This machine's Apple chip ("Apple M2 Max"), or None when there is none."""
    if mx.metal.is_available():
        name = mx.metal.device_info().get("device_name")
        if name:
            return str(name)
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                check=False,
                capture_output=True,
                text=True,
            )
            return out.stdout.strip() or None
        except OSError:
            return None
    return None


def chip_bandwidth(chip: str | None) -> float | None:
    """The published bandwidth (bytes/s) of a chip name's class, None if unknown."""
    if chip is None:
        return None
    words = chip.replace("Apple", "").split()
    for length in (2, 1):  # "M2 Max" before "M2"
        gbs = CHIP_BANDWIDTH_GBS.get(" ".join(words[:length]))
        if gbs is not None:
            return gbs * 1e9
    return None


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def _row_bytes(table: nn.Module) -> int:
    """Bytes of one looked-up row of an embedding table (its linears read whole)."""
    total = 0
    for name, value in tree_flatten(table.parameters()):
        table_part = name in ("weight", "scales", "biases")
        total += value.nbytes // value.shape[0] if table_part else value.nbytes
    return total


def frame_bytes(lm: Lm, n_q: int | None = None, full_context: bool = True) -> tuple[int, int]:
    """(weight bytes, other bytes) one frame reads with the first `n_q` codebooks generated
    (None: all): weights as `lm` holds them; others the KV cache (at full context when
    `full_context`) and the voices' cross-attention keys and values (one voice slot each)."""
    config = lm.config
    n_q = config.dep_q if n_q is None else n_q
    tables = [lm.text_emb, *lm.audio_embs]
    weights = _nbytes(lm) - sum(_nbytes(t) for t in tables) + sum(_row_bytes(t) for t in tables)
    if config.dep_q:
        depformer = lm.depformer
        weights -= _nbytes(depformer)
        for depformer_slice in depformer.slices[:n_q]:
            weights += _nbytes(depformer_slice) - _nbytes(depformer_slice.emb)
            weights += _row_bytes(depformer_slice.emb)
    if "condition_provider" in lm:
        weights -= _nbytes(lm.condition_provider)
    act = 2 if lm.out_norm.weight.dtype != mx.float32 else 4
    positions = config.context if full_context else 1
    others = 2 * config.num_layers * positions * config.kv_dim * act
    if config.cross_attention:
        others += 2 * config.num_layers * 125 * config.dim * act  # a published voice: 125 frames
    return weights, others


def frame_ops(lm: Lm, n_q: int | None = None) -> int:
    """The compiled step's operations per frame with `n_q` codebooks (None: all)."""
    config = lm.config
    n_q = config.dep_q if n_q is None else n_q
    layers = config.num_layers + n_q * config.depformer_num_layers
    return OPS_PER_LAYER * layers + OPS_PER_SAMPLE * (1 + n_q)


@dataclass(frozen=True)
class SpeedPlan:
    """The estimated frame time of one model on one chip class (`plan_speed`)."""

    chip: str | None
    bandwidth: float | None  # bytes/s; None: an unknown chip
    weight_bytes: int
    other_bytes: int
    ops: int
    n_q: int
    bits: int | None  # the weights' quantization (None: as loaded)
    advice: tuple[int, int | None] | None = None  # (n_q, bits) that make it real time

    @property
    def frame_seconds(self) -> float | None:
        if self.bandwidth is None:
            return None
        return (self.weight_bytes + self.other_bytes) / self.bandwidth + self.ops * OP_SECONDS

    @property
    def real_time_factor(self) -> float | None:
        """Seconds of audio per second (>= 1: real time); None for an unknown chip."""
        seconds = self.frame_seconds
        return None if seconds is None else FRAME_SECONDS / seconds

    def line(self) -> str:
        """The plan in one line, with the advice in API terms (`n_q`, `bits`)."""
        if self.bandwidth is None:
            return f"speed plan: unknown chip ({self.chip or 'no Apple GPU'}): no estimate"
        gb = (self.weight_bytes + self.other_bytes) / 1e9
        text = (
            f"speed plan (an estimate until measured): {self.chip}, "
            f"{self.bandwidth / 1e9:.0f} GB/s: a frame reads {gb:.2f} GB in about {self.ops} "
            f"operations, {1000 * self.frame_seconds:.0f} ms per 80 ms frame, "
            f"{self.real_time_factor:.2f}x real time"
        )
        if self.real_time_factor >= 1:
            return text
        if self.advice is None:
            return text + "; not real time with 8 bits and 8 codebooks either"
        n_q, bits = self.advice
        changes = [f"bits={bits}"] if bits else []
        changes += [f"n_q={n_q}"] if n_q != self.n_q else []
        return text + "; real time with " + " and ".join(changes)


def plan_speed(lm: Lm, chip: str | None = None, n_q: int | None = None) -> SpeedPlan:
    """The speed plan of `lm` generating `n_q` codebooks (None: all) on `chip` (None: this
    machine's, `chip_name`), with the fewest changes that would make it real time: 8 bits
    alone, then 24, 16 or 8 codebooks without and with 8 bits."""
    chip = chip_name() if chip is None else chip
    n_q = lm.config.dep_q if n_q is None else n_q
    plan = _plan(lm, chip, n_q, None)
    if plan.real_time_factor is None or plan.real_time_factor >= 1:
        return plan
    bits_choices = (None,) if isinstance(lm.text_linear, nn.QuantizedLinear) else (None, 8)
    candidates = [(n_q, bits) for bits in bits_choices[1:]]
    candidates += [(q, bits) for q in (24, 16, 8) if q < n_q for bits in bits_choices]
    for fewer, bits in candidates:
        if _plan(lm, chip, fewer, bits).real_time_factor >= 1:
            return SpeedPlan(**{**plan.__dict__, "advice": (fewer, bits)})
    return plan


def _plan(lm: Lm, chip: str | None, n_q: int, bits: int | None) -> SpeedPlan:
    weights, others = frame_bytes(lm, n_q)
    if bits is not None:  # matrices from the loaded dtype to 8 bits
        weights = int(weights * Q8_BYTES_PER_WEIGHT / lm.out_norm.weight.dtype.size)
    return SpeedPlan(chip, chip_bandwidth(chip), weights, others, frame_ops(lm, n_q), n_q, bits)
