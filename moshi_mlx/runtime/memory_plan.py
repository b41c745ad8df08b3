"""How much memory a Moshi model will take, planned before any weight is read.

Arithmetic over what the LM file's header says (`checkpoints.header.LmHeader`: the tensors as
loaded, the quantization, the compute dtype) and the options: the LM weights as they will sit
in memory (packed quantized tensors as stored, floating tensors in the compute dtype; of
PersonaPlex's 16-step depformer, the 8 slices that are sampled), the temporal transformer's KV
ring at the full context (optionally quantized; Hibiki's holds 2 rows, for classifier-free
guidance), the Mimi codec with its streaming state, and the activations of one step.
`check_fits` compares the total with what the device can hold (on Apple GPUs MLX's
recommended working set, on the CPU the RAM the system has free) and, when it does not fit,
says in one line which choices would.

The sizes are the arrays' own. MLX's allocator may give an array a cached buffer up to two
pages larger (one freed while loading): with Apple's 16 KiB pages, at most 13 MB over a 7B
bf16 file's 523 tensors (0.1% of its weights) and 36 MB over a q8 or q4 file's 1247 (0.4%,
0.75%), less than the activations' fixed overhead.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from moshi_mlx.checkpoints.header import LmHeader
from moshi_mlx.checkpoints.io import Layout
from moshi_mlx.checkpoints.spec import DEFAULT_GROUP_SIZE, output_layout
from moshi_mlx.errors import ConfigError, Setting
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.models.mimi import Mimi, MimiConfig
from moshi_mlx.modules.kv_quant import KV_BITS, KVQuantization, recent_slots

# One step's transient arrays beyond the logits (attention scores, feed-forward hidden
# states, sampling) and MLX's compiled-graph buffers: measured well under this at 7B shape.
_STEP_OVERHEAD_BYTES = 64 << 20
_SHARED_PART = re.compile(r"depformer\.slices\.([0-9]+)\.(?:linear_in|transformer)\.")
_MIN_USEFUL_CONTEXT = 250  # 20 s of conversation: below this a shorter context is no advice


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes each part of a loaded model needs, and what the device can hold."""

    weights: int
    kv_cache: int
    codec: int
    activations: int
    capacity: int
    device: str  # what `capacity` is, in words
    context: int
    kv: KVQuantization | None  # the KV cache's quantization (None: the compute dtype)
    dtype: mx.Dtype  # the LM's compute dtype
    lm_bits: int | None  # the LM file's quantization (None: unquantized)
    rows: int = 1  # batch rows of a conversation (`guidance_rows`)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.codec + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def table(self) -> str:
        """The plan as a small text table, in GB."""
        guided = ", 2 rows: guidance" if self.rows == 2 else ""
        cache = f"KV cache ({self.context} steps, {_kv_name(self.kv)}{guided})"
        rows = [
            ("LM weights", self.weights),
            (cache, self.kv_cache),
            ("Mimi codec", self.codec),
            ("activations", self.activations),
            ("total", self.total),
            (self.device, self.capacity),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {size / 1e9:7.2f} GB" for name, size in rows]
        lines.append("fits" if self.fits else "does not fit")
        return "\n".join(lines)


def _kv_name(kv: KVQuantization | None) -> str:
    return "unquantized" if kv is None else f"{kv.bits}-bit"


def _shared_copy(name: str, schedule: tuple[int, ...] | None) -> bool:
    """Whether `name` is a depformer slice's copy of the weights it shares with the first
    slice of its weight set (`Depformer.share_scheduled_weights`: held once in memory)."""
    found = _SHARED_PART.match(name)
    if schedule is None or found is None:
        return False
    k = int(found.group(1))
    return schedule.index(schedule[k]) != k


def lm_weight_bytes(layout: Layout, dtype: mx.Dtype, config: LmConfig | None = None) -> int:
    """Bytes of an LM file's tensors once loaded: packed integers as stored, floating tensors
    cast to the compute dtype; with `config`, the depformer's weights shared by several slices
    (a weights-per-step schedule: the TTS, Hibiki-Zero) once."""
    schedule = None if config is None else config.depformer_weights_per_step_schedule
    total = 0
    for name, (shape, stored) in layout.items():
        if _shared_copy(name, schedule):
            continue
        itemsize = stored.size if not mx.issubdtype(stored, mx.floating) else dtype.size
        total += math.prod(shape) * itemsize
    return total


def quantized_lm_weight_bytes(
    config: LmConfig, bits: int, dtype: mx.Dtype, group_size: int | None = None
) -> int:
    """Bytes of the LM's weights quantized as Kyutai's files are (by default with their group
    size), with no file at hand."""
    group_size = group_size or DEFAULT_GROUP_SIZE[bits]
    shapes = {name: p.shape for name, p in tree_flatten(Lm(config).parameters())}  # lazy
    return lm_weight_bytes(output_layout(shapes, bits, group_size), dtype, config)


def guidance_rows(config: LmConfig) -> int:
    """Batch rows a conversation runs: 2 for a conditioned model (Hibiki), planned for its
    classifier-free guidance (`ChatStepper`; with cfg_coef 1 it uses one), and for a TTS
    guided by a null row (`LmConfig.direct_guidance`), else 1."""
    return 2 if config.conditioners or config.direct_guidance else 1


def kv_cache_bytes(
    config: LmConfig,
    dtype: mx.Dtype,
    kv: KVQuantization | None = None,
    positions: int | None = None,
) -> int:
    """Keys and values of the temporal transformer's ring for `positions` (default: the
    context), in the compute dtype or packed by the KV quantization (plus its unquantized
    ring of the newest positions), for each of the `guidance_rows`."""
    positions = config.context if positions is None else positions
    per_position = 2 * config.num_layers * config.kv_dim * guidance_rows(config)  # k and v
    values = per_position * positions
    if kv is None:
        return values * dtype.size
    recent = per_position * recent_slots(config.context) * dtype.size
    return values * kv.bits // 8 + 2 * (values // kv.group_size) * dtype.size + recent


def codec_bytes(
    backend: str, mimi_file: str | Path, num_codebooks: int, config: MimiConfig | None = None
) -> int:
    """The codec's weights (our MLX Mimi in float32, with its codebook search tables and
    streaming caches), or for
    rustymimi, which keeps them outside MLX, the file's size."""
    if backend != "mlx":
        return Path(mimi_file).stat().st_size
    config = config or MimiConfig.moshi()
    mimi = Mimi(config, num_codebooks)  # lazy: nothing is allocated
    transformer = config.transformer
    caches = 2 * 2 * transformer.num_layers * transformer.context * transformer.d_model
    tables = sum(table.size for table in mimi.quantizer.search_tables())
    weights = sum(p.size for _, p in tree_flatten(mimi.parameters()))  # none shared
    return (weights + tables + caches) * mx.float32.size


def activation_bytes(config: LmConfig) -> int:
    """One step's transient arrays: the logits of every stream, the depformer's one-step
    cache (of each of the `guidance_rows`), and a fixed overhead."""
    logits = config.text_vocab_out + config.dep_q * config.card
    depformer = 2 * config.depformer_num_layers * config.dep_q * config.depformer_dim
    rows = guidance_rows(config)
    return 4 * rows * (logits + depformer) * mx.float32.size + _STEP_OVERHEAD_BYTES


def device_capacity() -> tuple[int, str]:
    """(bytes, description) of the memory the model may use on MLX's default device."""
    if mx.default_device().type == mx.DeviceType.gpu:
        info = mx.device_info()
        size = info.get("max_recommended_working_set_size") or info.get("memory_size", 0)
        return int(size), "GPU working set"
    return _available_ram(), "free RAM"


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_memory(
    lm: LmHeader,
    codec: int,
    dtype: mx.Dtype | None = None,
    kv: KVQuantization | None = None,
    capacity: tuple[int, str] | None = None,
) -> MemoryPlan:
    """The memory plan of a model about to be loaded (see the module docstring): arithmetic
    over what its LM file's header says (`lm`, whose config's context is the one planned), the
    codec's bytes (`codec_bytes`), the compute `dtype` (default: the one `lm` records, which
    the loader chooses), the KV cache's quantization and the device's `capacity` (bytes, in
    words; default: `device_capacity`)."""
    dtype = dtype or lm.dtype
    config = lm.config
    size, device = capacity or device_capacity()
    return MemoryPlan(
        weights=lm_weight_bytes(lm.layout, dtype, config),
        kv_cache=kv_cache_bytes(config, dtype, kv),
        codec=codec,
        activations=activation_bytes(config),
        capacity=size,
        device=device,
        context=config.context,
        kv=kv,
        dtype=dtype,
        lm_bits=lm.quantization[0] if lm.quantization else None,
        rows=guidance_rows(config),
    )


def fit_advice(plan: MemoryPlan, config: LmConfig) -> list[tuple[str | Setting, ...]]:
    """Up to three choices that make a plan that does not fit fit, as `MoshiModel.load`
    parameters (`quantize=4 kv_bits=8`, message parts) with what they come to (empty when
    none does)."""
    dtype = plan.dtype

    def with_kv(kv: KVQuantization | None, context: int | None = None) -> MemoryPlan:
        sized = config if context is None else replace(config, context=context)
        return replace(
            plan, kv_cache=kv_cache_bytes(sized, dtype, kv), kv=kv, context=sized.context
        )

    def longest_context(candidate: MemoryPlan) -> int:
        empty = kv_cache_bytes(config, dtype, candidate.kv, positions=0)
        per_step = kv_cache_bytes(config, dtype, candidate.kv, positions=1) - empty
        room = candidate.capacity - (candidate.total - candidate.kv_cache + empty)
        return int(min(max(room, 0) // per_step, config.context - 1))

    current = plan.kv.bits if plan.kv else 16
    smaller_kv = [
        KVQuantization.of(bits) for bits in sorted(KV_BITS, reverse=True) if bits < current
    ]
    candidates: list[tuple[tuple[str | Setting, ...], MemoryPlan]] = []
    q4_setting = Setting("quantize", 4)
    if plan.lm_bits != 4:
        q4 = quantized_lm_weight_bytes(config, 4, dtype)
        candidates.append(((q4_setting,), replace(plan, weights=q4)))
        candidates += [
            ((q4_setting, " ", Setting("kv_bits", kv.bits)), replace(with_kv(kv), weights=q4))
            for kv in smaller_kv
        ]
    candidates += [((Setting("kv_bits", kv.bits),), with_kv(kv)) for kv in smaller_kv]
    q4g64 = quantized_lm_weight_bytes(config, 4, dtype, group_size=64)
    if q4g64 < plan.weights:
        requantize = "a q4 file of group size 64 (python -m moshi_mlx quantize --group-size 64)"
        for kv in (plan.kv, *smaller_kv):
            more = () if kv == plan.kv else (" and ", Setting("kv_bits", kv.bits))
            candidates.append(((requantize, *more), replace(with_kv(kv), weights=q4g64)))
    for kv in (plan.kv, *smaller_kv[-1:]):
        context = longest_context(with_kv(kv))
        if context >= _MIN_USEFUL_CONTEXT and not with_kv(kv).fits:
            flags: tuple[str | Setting, ...] = (Setting("context", context),)
            if kv != plan.kv:
                flags = (Setting("kv_bits", kv.bits), " ", *flags)
            candidates.append((flags, with_kv(kv, context)))
    fitting = [(flags, option) for flags, option in candidates if option.fits]
    return [(*flags, f" ({option.total / 1e9:.2f} GB)") for flags, option in fitting[:3]]


def check_fits(plan: MemoryPlan, config: LmConfig) -> None:
    """Raise `ConfigError` with one line of advice when the plan does not fit."""
    if plan.fits:
        return
    needs = (
        f"Moshi needs {plan.total / 1e9:.2f} GB (weights {plan.weights / 1e9:.2f}, KV cache "
        f"{plan.kv_cache / 1e9:.2f} for {plan.context} steps, Mimi {plan.codec / 1e9:.2f}) but "
        f"the {plan.device} is {plan.capacity / 1e9:.2f} GB"
    )
    options = fit_advice(plan, config)
    advice: list[str | Setting] = ["; no smaller choice fits"]
    if options:
        advice = ["; it fits with "]
        for number, option in enumerate(options):
            advice += [" or "] * (number > 0) + list(option)
    raise ConfigError(needs, *advice, " (see ", Setting("memory_plan"), ")")


@contextmanager
def wired_memory(plan: MemoryPlan | None) -> Iterator[None]:
    """On Apple GPUs, keep the model's memory wired (resident) while in the block, then put
    MLX's previous wired limit back once the work queued in the block is done (as mlx-lm's
    `wired_limit`: lowering the limit under running kernels would unwire their buffers).
    Elsewhere, or without a plan, it does nothing."""
    if plan is None or not mx.metal.is_available():
        yield
        return
    previous = mx.set_wired_limit(min(plan.total, plan.capacity))
    try:
        yield
    finally:
        mx.synchronize()
        mx.set_wired_limit(previous)
