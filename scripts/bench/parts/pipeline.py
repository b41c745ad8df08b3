"""The `pipeline` part: encode + LM step + decode per 80 ms frame as `Conversation.step` runs
it, real-time factor, time to the first audio frame, host time and syncs per frame."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_stats import FRAME_MS, summarize

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.model import step_frame
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.codec import load_codec
from moshi_mlx.testing.checkpoints import load_lm

from ..part import Part, backend_dtype_label, real_time_factor_notes
from ..shapes import DTYPES, LM_SHAPES, dtype_label, lm_shapes, noise_frames
from ..timing import SyncMeter, fresh_memory, peak_gb
from ..weights import lm_weights, mimi_weights


def bench_pipeline(
    lm_file: Path,
    mimi_file: Path,
    shape: str,
    backend: str,
    frames: int,
    warmup: int,
    seed: int,
    dtype: mx.Dtype | None = None,
) -> dict:
    """Encode the user's frame, step the LM, decode Moshi's frame: ms per 80 ms frame, as
    `Conversation.step` runs it (`api.step_frame`: one evaluation per frame); host time
    outside evaluation, time in evaluation and syncs per frame (`SyncMeter`)."""
    fresh_memory()
    lm = load_lm(lm_file, LmConfig.from_dict(LM_SHAPES[shape]), dtype=dtype)
    codec = load_codec(mimi_file, backend=backend)
    gen = ChatStepper(lm, seed=seed)

    def frame_step(pcm: np.ndarray) -> bool:
        step, reply = step_frame(gen, codec, pcm)
        _ = step.text.item(), None if reply is None else np.array(reply)
        return reply is not None

    def run(pcm_frames: np.ndarray, meter: SyncMeter) -> dict:
        gen.reset()
        codec.reset()
        times, host, syncs, first_audio_s = [], [], [], None
        start = time.perf_counter()
        for pcm in pcm_frames:
            meter.new_frame()
            syncs_before, wait_before = meter.syncs, meter.wait_s
            t0 = time.perf_counter()
            audio = frame_step(pcm)
            times.append(time.perf_counter() - t0)
            host.append(times[-1] - (meter.wait_s - wait_before))
            syncs.append(meter.syncs - syncs_before)
            if audio and first_audio_s is None:
                first_audio_s = time.perf_counter() - start
        return {"times": times, "host": host, "syncs": syncs, "first_audio_s": first_audio_s}

    pcm_frames = noise_frames(warmup + frames, seed)
    with SyncMeter() as meter:
        run(pcm_frames[:warmup], meter)  # compile/allocate, then start a fresh conversation
        mx.reset_peak_memory()
        measured = run(pcm_frames, meter)
    frame = summarize(measured["times"][warmup:])
    first_audio_s = measured["first_audio_s"]
    return {
        "impl": "ours",
        "backend": backend,
        "dtype": dtype_label(dtype, lm),
        "frame_ms": frame,
        "host_ms": summarize(measured["host"][warmup:]),
        "syncs_per_frame": float(np.mean(measured["syncs"][warmup:])),
        "real_time_factor": FRAME_MS / frame["p50"],
        "first_audio_ms": None if first_audio_s is None else 1000 * first_audio_s,
        "peak_memory_gb": peak_gb(),
    }


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per LM shape, quant, dtype and codec backend."""
    mimi_file = mimi_weights(folder)
    for shape in lm_shapes(args.shapes):
        for quant in args.quant:
            lm_file = lm_weights(folder, shape, quant)
            for dtype in args.dtype:
                for backend in args.codec:
                    case = {"part": "pipeline", "shape": shape, "quant": quant}
                    case["ours"] = bench_pipeline(
                        lm_file,
                        mimi_file,
                        shape,
                        backend,
                        args.frames,
                        args.warmup,
                        args.seed,
                        DTYPES[dtype],
                    )
                    yield case


PART = Part(
    "pipeline",
    cases,
    metrics=lambda case: ("frame_ms", "host_ms"),
    label=backend_dtype_label,
    notes=real_time_factor_notes,
)
