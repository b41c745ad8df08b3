"""What the parts share to time a step: MLX's memory, host syncs, graph sizes, LM steps."""

from __future__ import annotations

import gc
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.runtime.step_state import StepOutput

if TYPE_CHECKING:
    from typing_extensions import Self


def fresh_memory() -> None:
    """Free what the last case left (Python's garbage, MLX's buffer cache) and reset MLX's
    peak memory, so the next case's peak is its own."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def peak_gb() -> float:
    """MLX's peak memory since the last reset, GB."""
    return mx.get_peak_memory() / 1e9


def compiled_temporal_step(lm: Lm):
    """The temporal transformer with the text head over a `KVRing`, compiled as in a step:
    (tokens (1, K, 1), ring keys, values, position) -> (out, text logits, next keys, values,
    position)."""
    config = lm.config

    def temporal_step(tokens: mx.array, keys: list, values: list, position: mx.array):
        ring = KVRing(keys, values, position, config.context)
        out, text_logits = lm.step_text(tokens, ring)
        ring = ring.advanced()
        return out, text_logits, ring.keys, ring.values, ring.position

    return mx.compile(temporal_step)


class SyncMeter:
    """Counts host synchronisations, and the time the host waits in them, while active.

    Wraps `mx.eval`, `mx.array.item`, `mx.array.tolist` and numpy's array conversions. A call
    counts as a sync when it touches an array that no earlier call of the same frame
    evaluated or read (`new_frame()` forgets them): reading a token of an array the frame
    already evaluated costs no wait. `mx.async_eval` does not make the host wait for the
    result (no sync), but the time it takes to launch the work counts as evaluation time
    (`wait_s`): on MLX's CPU backend it runs the graph's operations before it returns.
    """

    def __init__(self):
        self.syncs = 0
        self.wait_s = 0.0
        self._seen: dict[int, mx.array] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def new_frame(self) -> None:
        self._seen.clear()

    def _wrap(self, fn, waits: bool):
        def measured(*args, **kwargs):
            arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
            fresh = [a for a in arrays if id(a) not in self._seen]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if fresh:
                    self.wait_s += time.perf_counter() - start
                if fresh and waits:
                    self.syncs += 1
                    self._seen.update((id(a), a) for a in arrays)

        return measured

    def __enter__(self) -> Self:
        wrapped = [(mx, "eval"), (mx, "async_eval"), (mx.array, "item"), (mx.array, "tolist")]
        for owner, name in [*wrapped, (np, "array"), (np, "asarray"), (np, "ascontiguousarray")]:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, waits=name != "async_eval"))
        return self

    def __exit__(self, *exc_info) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


T = TypeVar("T")


def syncs_per_frame(frames: Iterable[T], run: Callable[[T], object]) -> float | None:
    """The host syncs `run` makes per item of `frames`, each a new frame of a `SyncMeter`
    (their mean; None for no frames)."""
    syncs = []
    with SyncMeter() as meter:
        for frame in frames:
            meter.new_frame()
            before = meter.syncs
            run(frame)
            syncs.append(meter.syncs - before)
    return float(np.mean(syncs)) if syncs else None


def _dot(outputs, names: dict[str, mx.array] | None = None) -> str:
    """MLX's own export (`mx.export_to_dot`) of the lazy graph computing `outputs`, the
    arrays of `names` named by their keys."""
    arrays = [a for _, a in tree_flatten(list(outputs)) if isinstance(a, mx.array)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *arrays, **(names or {}))
        return path.read_text()


def count_graph_ops(outputs) -> int:
    """Operations (primitives) in the lazy graph that computes `outputs`, evaluated inputs
    excluded, from MLX's own graph export (`mx.export_to_dot`)."""
    return _dot(outputs).count("shape=rectangle")


def ops_by_primitive(outputs, names: dict[str, mx.array] | None = None) -> dict[str, int]:
    """`count_graph_ops` by primitive name, most frequent first; `mx.compile`'s fused
    elementwise kernels (`Compiled...`) counted together as "Compiled". A `Depends` node fed
    by an array of `names` counts under its name (`form.kernel_form`'s kernels)."""
    text = _dot(outputs, names)
    labels = dict(re.findall(r'(\d+) \[label ="?([A-Za-z_]+)[^"]*"?, shape=rectangle', text))
    for name in names or {}:
        for node in re.findall(rf'"{name}" -> (\d+)', text):
            labels[node] = name
    kinds = ("Compiled" if name.startswith("Compiled") else name for name in labels.values())
    return dict(Counter(kinds).most_common())


def read_chat_step(out: StepOutput) -> tuple[int, np.ndarray | None]:
    """A chat step's text token and Moshi's codes (None until the delays fill) on the host,
    as a caller reads them: one evaluation."""
    mx.eval(out.text, out.frame)
    return out.text.item(), None if out.frame is None else np.array(out.frame, np.int32)


def timed_step(gen: ChatStepper, codes: np.ndarray) -> float:
    """Seconds of one `ChatStepper.step` with its text token and Moshi's codes read on the
    host."""
    start = time.perf_counter()
    read_chat_step(gen.step(codes))
    return time.perf_counter() - start
