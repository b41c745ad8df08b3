"""The `stt` part: speech-to-text throughput as `SpeechToText` steps, one stream against
`--streams` in one batch, at a stream's start and over the whole attention window (shapes
`stt-*`). Printed as lines of its own, outside the table."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.codec import load_codec
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.testing.checkpoints import load_lm

from ..part import Part
from ..shapes import LM_SHAPES, lm_shapes
from ..weights import lm_weights, mimi_weights


def bench_stt(
    lm_file: Path, mimi_file: Path, shape: str, backend: str, streams: int, steps: int, seed: int
) -> dict:
    """Speech-to-text throughput as `SpeechToText` steps (every stream's Mimi encoding in one
    batch, then the LM step), for one stream and for `streams` in one batch, as seconds of
    audio per second. The two take their steps in turn, so both see the same machine; at a
    stream's start (the KV ring's first bucket) and with the whole attention window (the ring
    reserved to the context, as every step of a stream past `context` steps pays)."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    lm = load_lm(lm_file, config)
    codec = load_codec(mimi_file, backend, config.n_q)
    rng = np.random.default_rng(seed)
    result = {"streams": streams, "ld_preload": os.environ.get("LD_PRELOAD", "")}
    for window in ("start", "full"):
        runs = {}
        for count in (1, streams):
            stepper = SttStepper(lm, count)
            if window == "full":
                stepper.reserve(config.context)
            runs[count] = (codec.batch_encoder(count), stepper, [])
        for step in range(steps + 3):
            for count, (encoder, stepper, times) in runs.items():
                pcm = rng.normal(0, 0.1, (count, 1920)).astype(np.float32)
                started = time.perf_counter()
                out = stepper.step(encoder.encode_frames(pcm))
                mx.eval(out.text, out.head_probabilities, encoder.state)
                if step >= 3:  # the first steps compile
                    times.append(time.perf_counter() - started)
        for count, (_, _, times) in runs.items():
            step_s = float(np.median(times))
            result[f"{window}_step_ms_{count}"] = 1000 * step_s
            result[f"{window}_audio_per_s_{count}"] = count * 0.08 / step_s
        ratio = result[f"{window}_audio_per_s_{streams}"] / result[f"{window}_audio_per_s_1"]
        result[f"{window}_speedup"] = ratio
        runs.clear()
    return result


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per `stt-*` shape, quant and codec backend."""
    mimi_file = mimi_weights(folder)
    for shape in [shape for shape in lm_shapes(args.shapes) if shape.startswith("stt")]:
        for quant in args.quant:
            for backend in args.codec:
                ours = bench_stt(
                    lm_weights(folder, shape, quant), mimi_file, shape, backend,
                    args.streams, args.steps, args.seed,
                )  # fmt: skip
                yield {
                    "part": "stt",
                    "shape": shape,
                    "quant": quant,
                    "codec": backend,
                    "ours": ours,
                }


def summary(case: dict) -> str:
    """Per window: ms per step and seconds of audio per second, 1 stream and the batch."""
    ours, streams = case["ours"], case["ours"]["streams"]
    lines = []
    for window in ("start", "full"):
        lines.append(
            f"stt {case['shape']} {case['quant']} {case['codec']} ({window} window): 1 stream "
            f"{ours[f'{window}_step_ms_1']:.0f} ms/step "
            f"({ours[f'{window}_audio_per_s_1']:.2f} s of audio/s); "
            f"{streams} streams "
            f"{ours[f'{window}_step_ms_{streams}']:.0f} ms/step "
            f"({ours[f'{window}_audio_per_s_{streams}']:.2f} s/s): "
            f"{ours[f'{window}_speedup']:.2f}x"
        )
    return "\n".join(lines)


PART = Part("stt", cases, summary=summary)
