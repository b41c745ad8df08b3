"""The `kv` part: a conversation's KV ring at its full context, unquantized or quantized
(`--kv-bits`): peak memory, planned cache and step time, the caches stepped in turn."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_stats import summarize

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.memory_plan import kv_cache_bytes
from moshi_mlx.testing.checkpoints import load_lm

from ..part import Part
from ..shapes import DTYPES, LM_SHAPES, dtype_label, lm_shapes, user_codes
from ..timing import fresh_memory
from ..weights import lm_weights


def bench_kv_caches(
    weights: Path,
    shape: str,
    kv_bits: list[int | None],
    steps: int,
    seed: int,
    dtype: mx.Dtype | None,
) -> list[dict]:
    """Conversations with the KV ring allocated at the full context (as after `context`
    steps), the cache unquantized or in each of `kv_bits`, over one load of the weights.

    Per cache: the peak MLX memory of the load plus a compiled step and one more (each cache
    alone, the others freed), the planned cache, and the step time when every slot of the
    ring is attended over, with the caches stepped in turn (one step each, `steps` times) so
    that the machine's load hits them alike; `ratio` is the median of each turn's step time
    over the first cache's."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    fresh_memory()
    lm = load_lm(weights, config, dtype=dtype)
    mx.eval(lm.parameters())
    weights_gb = mx.get_active_memory() / 1e9
    load_peak = mx.get_peak_memory()
    user = user_codes(config.card, steps + 2, seed, config.num_user_codebooks)

    def generator(bits: int | None) -> ChatStepper:
        quantization = KVQuantization.of(bits) if bits else None
        gen = ChatStepper(lm, seed=seed, kv_quantization=quantization)
        gen.reserve(lm.config.attention_window)
        return gen

    def timed_step(gen: ChatStepper, codes: np.ndarray) -> float:
        start = time.perf_counter()
        mx.eval(gen.step(codes).text)
        return time.perf_counter() - start

    peaks = []
    for bits in kv_bits:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        gen = generator(bits)
        for codes in user[:2]:  # compile and allocate, then a step
            timed_step(gen, codes)
        peaks.append(max(load_peak, mx.get_peak_memory()) / 1e9)
        del gen
    gens = [generator(bits) for bits in kv_bits]
    for gen in gens:
        timed_step(gen, user[0])
    times = [[timed_step(gen, codes) for gen in gens] for codes in user[2:]]
    dtype_used = lm.out_norm.weight.dtype
    return [
        {
            "impl": "ours",
            "kv": f"{bits}-bit" if bits else "unquantized",
            "dtype": dtype_label(dtype, lm),
            "step_ms": summarize([turn[i] for turn in times]),
            "ratio": float(np.median([turn[i] / turn[0] for turn in times])),
            "weights_gb": weights_gb,
            "planned_kv_gb": kv_cache_bytes(config, dtype_used, gen.kv_quantization) / 1e9,
            "peak_memory_gb": peak,
        }
        for i, (bits, gen, peak) in enumerate(zip(kv_bits, gens, peaks))
    ]


def kv_cases(args: argparse.Namespace, folder: Path, part: str, bench) -> Iterator[dict]:
    """The cases of a KV part: `bench(weights, shape, kv_bits, steps, seed, dtype)`'s results
    per LM shape, quant and dtype (`--kv-bits`, less the unquantized cache for
    `kv-fidelity`: each quantized one is measured against it)."""
    kv_bits = [None if kv == "none" else int(kv) for kv in args.kv_bits]
    if part == "kv-fidelity":
        kv_bits = [bits for bits in kv_bits if bits is not None]
    for shape in lm_shapes(args.shapes):
        for quant in args.quant:
            weights = lm_weights(folder, shape, quant)
            for dtype in args.dtype:
                for ours in bench(weights, shape, kv_bits, args.steps, args.seed, DTYPES[dtype]):
                    yield {"part": part, "shape": shape, "quant": quant, "ours": ours}


def kv_label(data: dict) -> str:
    return f"{data['kv']}-{data['dtype']}"


def _ratio(metric: str, data: dict) -> str:  # against the unquantized cache, stepped in turn
    return f"{data['ratio']:.2f}"


PART = Part(
    "kv",
    lambda args, folder: kv_cases(args, folder, "kv", bench_kv_caches),
    metrics=lambda case: ("step_ms",),
    label=kv_label,
    ratio=_ratio,
)
