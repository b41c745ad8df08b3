"""Prompt states on disk, so a (weights, voice, role) prompt is computed once, ever.

A state is saved as a safetensors file named by a key over everything it depends on: the LM
file's content (its size, header and samples of its data: reading 16 GB to hash them would
cost more than the prompt), the codec's file, the voice file's bytes, the role's tokens, the
LM config, the compute dtype and the KV cache's quantization, and this format's version. The
arrays are the delayed tokens, their given marks and the KV ring's `state` (trimmed to the prompt's
positions), saved generically with their `meta_state` (`modules.streaming`). Files are
written atomically; the oldest are removed past `MAX_CACHED_PROMPTS`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from moshi_mlx.chat.generate import GenState
from moshi_mlx.files import written_atomically
from moshi_mlx.modules.streaming import flatten_states, unflatten_states

FORMAT_VERSION = 2  # 2: the ring saved through its `StreamingState`
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
    tree = {
        "tokens": state.tokens,
        "given": state.given.astype(mx.uint8),
        "ring": state.ring.trimmed(state.step_index),
    }
    arrays, metadata = flatten_states(tree)
    metadata["step_index"] = str(state.step_index)
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
        tree = unflatten_states(arrays, metadata)
        state = GenState(
            tokens=tree["tokens"],
            given=tree["given"].astype(mx.bool_),
            ring=tree["ring"],
            step_index=int(metadata["step_index"]),
        )
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None
    os.utime(path)  # most recently used: trimmed last
    return state


def _trim(folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    for stale in files[:-MAX_CACHED_PROMPTS]:
        stale.unlink(missing_ok=True)
