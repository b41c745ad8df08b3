"""Late steps and what happened in them (issue 42, steady latency): per step, whether the KV
ring grew (a new bucket: a new shape, so the compiled step is traced again), Python's garbage
collector ran, or MLX took new memory from the system (its buffer cache had none to reuse); a
late step with none of these is the machine's (another process, the OS, the device)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from typing_extensions import Self

EVENTS = ("ring growth", "gc", "new memory")
LATE = 1.5  # a step is late past this many times the median


def _held_bytes() -> int:
    """What MLX holds: arrays' memory and its buffer cache."""
    return mx.get_active_memory() + mx.get_cache_memory()


class StepEvents:
    """While active, `before()` and `after()` around each step record the step's events
    (`EVENTS`) in `per_step`; `capacity()` is the KV ring's slots."""

    def __init__(self, capacity: Callable[[], int]):
        self.capacity = capacity
        self.per_step: list[list[str]] = []
        self._gc_runs = 0
        self._before: tuple[int, int, int] = (0, 0, 0)

    def _count_gc(self, phase: str, info: dict) -> None:
        self._gc_runs += phase == "start"

    def __enter__(self) -> Self:
        gc.callbacks.append(self._count_gc)
        return self

    def __exit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._count_gc)

    def before(self) -> None:
        self._before = (self.capacity(), self._gc_runs, _held_bytes())

    def after(self) -> None:
        capacity, gc_runs, held = self._before
        happened = [self.capacity() != capacity, self._gc_runs != gc_runs, _held_bytes() > held]
        self.per_step.append([name for name, yes in zip(EVENTS, happened) if yes])


def late_steps(step_ms: list[float], events: list[list[str]]) -> dict:
    """The steps past `LATE` times the median: how many, how many had each event and none,
    and the step's p95 without the steps that had an event."""
    times = np.array(step_ms)
    threshold = LATE * float(np.median(times))
    late = [i for i, ms in enumerate(times) if ms > threshold]
    by_cause = {name: sum(name in events[i] for i in late) for name in EVENTS}
    by_cause["none"] = sum(not events[i] for i in late)
    quiet = [ms for ms, happened in zip(times, events) if not happened]
    return {
        "threshold_ms": threshold,
        "late": len(late),
        "steps": len(times),
        "late_steps": late,
        "by_cause": by_cause,
        "with_events": sum(bool(e) for e in events),
        "p95_quiet_ms": float(np.percentile(quiet, 95)) if quiet else None,
    }


def late_line(late: dict) -> str:
    """`late_steps` in one printed line."""
    causes = ", ".join(f"{count} with {name}" for name, count in late["by_cause"].items() if count)
    line = f"  late steps (> {LATE}x p50, {late['threshold_ms']:.1f} ms): {late['late']} of "
    line += f"{late['steps']}" + (f" ({causes})" if causes else "")
    if late["p95_quiet_ms"] is not None:
        line += f"; p95 of the {late['steps'] - late['with_events']} steps without an event "
        line += f"{late['p95_quiet_ms']:.2f} ms"
    return line
