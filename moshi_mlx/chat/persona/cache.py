"""Prompt states on disk, so a (weights, voice, role) prompt is computed once, ever.

A state is saved as a safetensors file named by a key over everything it depends on: the LM
file's content (its size, header and samples of its data: reading 16 GB to hash them would
cost more than the prompt), the codec's file, the voice file's bytes, the role's tokens, the
LM config, the compute dtype and the KV cache's quantization, and this format's version. The
KV ring is saved up to the prompt's positions only. Files are written atomically; the
oldest are removed past `MAX_CACHED_PROMPTS`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from moshi_mlx.chat.generate import GenState
from moshi_mlx.files import written_atomically
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.kv_quant import KVQuantization

FORMAT_VERSION = 1
CACHE_ENV = "MOSHI_MLX_PROMPT_CACHE"
MAX_CACHED_PROMPTS = 16
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 20


def cache_dir() -> Path:
    """Where prompt states are kept: `$MOSHI_MLX_PROMPT_CACHE`, else ~/.cache/moshi_mlx/prompts."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "moshi_mlx" / "prompts"


def file_fingerprint(path: Path) -> str:
    """A hash of a weights file's size, first MB (the safetensors header) and samples of
    its data, spread evenly: it changes when the weights do."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as file:
        for index in range(_SAMPLES):
            file.seek(size * index // _SAMPLES)
            digest.update(file.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def prompt_key(**parts: object) -> str:
    """The cache key of a prompt from what it depends on (JSON-able values)."""
    text = json.dumps({"format": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save_state(folder: Path, key: str, state: GenState) -> Path:
    """Write `state` (evaluated here) as `folder/key.safetensors`."""
    ring = state.ring
    positions = state.step_index
    arrays = {
        "tokens": state.tokens,
        "given": state.given.astype(mx.uint8),
        "position": ring.position,
    }
    for name, buffers in (("keys", ring.keys), ("values", ring.values)):
        for layer, buffer in enumerate(buffers):
            parts = buffer if isinstance(buffer, tuple) else (buffer,)
            for index, part in enumerate(parts):
                kept = part if index == 3 else part[:, :, :positions]  # 3: the recent ring
                arrays[f"{name}.{layer}.{index}"] = kept
    metadata = {"step_index": str(positions), "context": str(ring.context)}
    if ring.quantization is not None:
        metadata["kv_bits"] = str(ring.quantization.bits)
        metadata["kv_group_size"] = str(ring.quantization.group_size)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.safetensors"
    with written_atomically(path) as partial:
        mx.save_safetensors(str(partial), arrays, metadata)
    _trim(folder)
    return path


def load_state(folder: Path, key: str) -> GenState | None:
    """The state saved under `key`, or None (none saved, or unreadable: it is recomputed)."""
    path = folder / f"{key}.safetensors"
    if not path.is_file():
        return None
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
        quantization = None
        if "kv_bits" in metadata:
            quantization = KVQuantization(int(metadata["kv_bits"]), int(metadata["kv_group_size"]))
        keys, values = _buffers(arrays, "keys"), _buffers(arrays, "values")
        ring = KVRing(keys, values, arrays["position"], int(metadata["context"]), quantization)
        state = GenState(
            tokens=arrays["tokens"],
            given=arrays["given"].astype(mx.bool_),
            ring=ring,
            step_index=int(metadata["step_index"]),
        )
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    os.utime(path)  # most recently used: trimmed last
    return state


def _buffers(arrays: dict[str, mx.array], name: str) -> list:
    buffers = []
    while f"{name}.{len(buffers)}.0" in arrays:
        layer = len(buffers)
        parts = []
        while f"{name}.{layer}.{len(parts)}" in arrays:
            parts.append(arrays[f"{name}.{layer}.{len(parts)}"])
        buffers.append(parts[0] if len(parts) == 1 else tuple(parts))
    return buffers


def _trim(folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    for stale in files[:-MAX_CACHED_PROMPTS]:
        stale.unlink(missing_ok=True)
