"""The start-up memory-plan line of `python -m moshi_mlx serve`: what the loaded combination
needs, and which Macs it fits (Metal lets a process use about 2/3 of a Mac's memory on 8-16 GB
machines, 3/4 above)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from moshi_mlx.serve.context import ServeContext

MACS_GB = (8, 16, 24)
STREAM_OVERHEAD_GB = 0.5  # a model's codec, caches and activations for a few streams


def _weights(module: object) -> tuple[int, int]:
    """(parameters, bytes) of an `nn.Module` (0, 0 for anything else)."""
    parameters = getattr(module, "parameters", None)
    if parameters is None:
        return 0, 0
    arrays = [a for _, a in tree_flatten(parameters()) if isinstance(a, mx.array)]
    return sum(a.size for a in arrays), sum(a.nbytes for a in arrays)


def _usable_gb(mac_gb: int) -> float:
    return mac_gb * (2 / 3 if mac_gb <= 16 else 3 / 4)


def memory_plan_line(context: ServeContext) -> str:
    """One line: each loaded model's parameters and weight bytes, the total with a margin for
    streams, and which of 8/16/24 GB Macs hold it."""
    parts, total = [], 0.0
    chat = context.chat.model if context.chat is not None else None
    loaded = (("chat", chat), ("STT", context.stt), ("TTS", context.tts), ("LLM", context.llm))
    for name, model in loaded:
        if model is None:
            continue
        lm = getattr(model, "lm", None) or getattr(model, "model", None) or model
        count, size = _weights(lm)
        gigabytes = size / 1e9 + STREAM_OVERHEAD_GB
        total += gigabytes
        parts.append(f"{name} {count / 1e9:.2f}B params ({size / 1e9:.1f} GB)")
    fits = [f"{gb} GB Mac: {'fits' if total <= _usable_gb(gb) else 'no'}" for gb in MACS_GB]
    return f"memory plan: {' + '.join(parts)}; ~{total:.1f} GB with streams; " + ", ".join(fits)
