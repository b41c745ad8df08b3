"""A part of the bench (`--parts NAME`): how its cases run, and how the table shows them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# (args, weights folder) -> each case as it is measured
Cases = Callable[[argparse.Namespace, Path], Iterator[dict]]


def no_metrics(case: dict) -> tuple[str, ...]:
    return ()


def no_ratio(metric: str, data: dict) -> str:
    return ""


def no_notes(label: str, data: dict, case: dict) -> list[str]:
    return []


def ours_label(data: dict) -> str:
    return f"ours-{data['dtype']}"


def backend_label(data: dict) -> str:
    return data["backend"]


def backend_dtype_label(data: dict) -> str:
    return f"{data['backend']}-{data.get('dtype', '')}".rstrip("-")


def real_time_factor_notes(label: str, data: dict, case: dict) -> list[str]:
    """A frame's real-time factor, and the first audio frame and syncs where measured."""
    if "real_time_factor" not in data:
        return []
    extra = f"  real-time factor {data['real_time_factor']:.3f}"
    if data.get("first_audio_ms") is not None:
        extra += f", first audio frame after {data['first_audio_ms']:.0f} ms"
    if data.get("syncs_per_frame") is not None:
        extra += f", syncs per frame {data['syncs_per_frame']:.2f}"
    return [extra]


@dataclass(frozen=True)
class Part:
    """One part of the bench.

    `cases(args, folder)` measures it, yielding each case as it comes: a dict for the JSON
    with `part`, its shape and quant where it has them, our result (`ours`) and Kyutai's
    (`kyutai`) where asked. The table shows a result's `metrics(case)` as rows (each a
    `summarize` dict: p50, p95), `label(result)` in the implementation column, the ratio to
    Kyutai's p50 or else `ratio(metric, result)`, and `notes(label, result, case)` below its
    rows. A part with a `summary` prints `summary(case)` for each case instead of rows, and
    stays out of the final table.
    """

    name: str
    cases: Cases
    metrics: Callable[[dict], tuple[str, ...]] = no_metrics
    label: Callable[[dict], str] = ours_label
    ratio: Callable[[str, dict], str] = no_ratio
    notes: Callable[[str, dict, dict], list[str]] = no_notes
    summary: Callable[[dict], str] | None = None
