"""The `mimi` part: ms per streaming 80 ms frame, encode and decode, per codec backend, and a
batch encode/decode of `--batch-seconds` of audio; with `--kyutai`, Kyutai's MLX Mimi."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_stats import FRAME_MS, summarize

from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.runtime.codec import load_codec

from ..kyutai import run_kyutai
from ..part import Part, backend_label, real_time_factor_notes
from ..shapes import noise_frames
from ..timing import fresh_memory, peak_gb
from ..weights import mimi_weights


def bench_codec(weights: Path, backend: str, frames: int, warmup: int, seed: int) -> dict:
    """ms per streaming frame through the `Codec` interface (numpy in, numpy out)."""
    fresh_memory()
    start = time.perf_counter()
    codec = load_codec(weights, backend=backend)
    load_s = time.perf_counter() - start
    mx.reset_peak_memory()
    encode, decode = [], []
    for pcm in noise_frames(warmup + frames, seed):
        t0 = time.perf_counter()
        codes = codec.encode_step(pcm)
        mx.eval(codes, codec.state)
        t1 = time.perf_counter()
        mx.eval(codec.decode_step(codes), codec.state)
        encode.append(t1 - t0)
        decode.append(time.perf_counter() - t1)
    frame = summarize([e + d for e, d in zip(encode, decode)][warmup:])
    return {
        "impl": "ours" if backend == "mlx" else backend,
        "backend": backend,
        "load_s": load_s,
        "encode_ms": summarize(encode[warmup:]),
        "decode_ms": summarize(decode[warmup:]),
        "frame_ms": frame,
        "real_time_factor": FRAME_MS / frame["p50"],
        "peak_memory_gb": peak_gb() if backend == "mlx" else None,
    }


def bench_codec_batch(weights: Path, backend: str, seconds: float, repeats: int, seed: int) -> dict:
    """ms to encode `seconds` of audio in one call, and to decode its codes back."""
    rng = np.random.default_rng(seed)
    pcm = (0.1 * rng.standard_normal(int(24_000 * seconds))).astype(np.float32)
    if backend == "mlx":
        mimi = load_mimi(weights)

        def encode():
            codes = mimi.encode(mx.array(pcm)[None, None])
            mx.eval(codes)
            return codes

        def decode(codes):
            mx.eval(mimi.decode(codes))
    else:
        import rustymimi

        tokenizer = rustymimi.Tokenizer(str(weights), num_codebooks=8)

        def encode():
            return tokenizer.encode(pcm[None, None])

        def decode(codes):
            tokenizer.decode(codes)

    encode_times, decode_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codes = encode()
        t1 = time.perf_counter()
        decode(codes)
        encode_times.append(t1 - t0)
        decode_times.append(time.perf_counter() - t1)
    return {"batch_encode_ms": summarize(encode_times), "batch_decode_ms": summarize(decode_times)}


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """One case per `--codec` backend."""
    mimi_file = mimi_weights(folder)
    common = ["--warmup", str(args.warmup), "--seed", str(args.seed)]
    for backend in args.codec:
        case = {"part": "mimi", "codec": backend}
        case["ours"] = bench_codec(mimi_file, backend, args.frames, args.warmup, args.seed)
        if args.batch_seconds > 0:
            case["ours"].update(
                bench_codec_batch(mimi_file, backend, args.batch_seconds, 2, args.seed)
            )
        if args.kyutai and backend == "mlx":
            extra = ["--frames", str(args.frames), *common]
            extra += ["--batch-seconds", str(args.batch_seconds)]
            case["kyutai"] = run_kyutai(args.kyutai_python, "mimi", mimi_file, extra)
        yield case


METRICS = ("encode_ms", "decode_ms", "frame_ms", "batch_encode_ms", "batch_decode_ms")
PART = Part(
    "mimi",
    cases,
    metrics=lambda case: METRICS,
    label=backend_label,
    notes=real_time_factor_notes,
)
