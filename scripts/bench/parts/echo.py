"""The `echo` part: ms of the live app's echo canceller, WebRTC AEC3, per 80 ms mic frame of a
simulated room with double talk (the canceller comparison is `scripts/echo_compare.py`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from bench_stats import summarize

from ..part import Part, backend_label


def bench_echo(frames: int, warmup: int, seed: int) -> dict:
    """Time of the live app's echo canceller per 80 ms mic frame (8 sub-frames of 10 ms) on
    the simulated room of `echo_path` (espeak-ng speech, or noise without espeak-ng)."""
    from moshi_mlx.audio.echo import EchoCanceller
    from moshi_mlx.testing import echo_path

    far = echo_path.speak(echo_path.FAR_TEXT)
    near = echo_path.speak(echo_path.NEAR_TEXT, voice="en+f3")
    if far is None or near is None:
        rng = np.random.default_rng(seed)
        far, near = (0.1 * rng.normal(size=16 * 24_000).astype(np.float32) for _ in range(2))
    scene, _ = echo_path.conversation_scene(far, near, delay_s=0.1, gain_db=-3.0, seed=seed)
    canceller = EchoCanceller()
    times = []
    total = min(warmup + frames, len(scene.mic) // 1920)
    for k in range(total):
        frame = slice(k * 1920, (k + 1) * 1920)
        started = time.perf_counter()
        canceller.process(scene.mic[frame], scene.far[frame])
        if k >= warmup:
            times.append(time.perf_counter() - started)
    return {"backend": "webrtc-aec3", "frame_ms": summarize(times)}


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """One case, over at least 100 frames."""
    yield {"part": "echo", "ours": bench_echo(max(args.frames, 100), args.warmup, args.seed)}


PART = Part("echo", cases, metrics=lambda case: ("frame_ms",), label=backend_label)
