"""Three streams joining and leaving one batch (`TtsBatch`, `SttBatch`): the third takes the
row the first frees."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class JoinedRun:
    """What `run_joining` saw: each stream's summarized steps, the step stream 2 joined at,
    and the streams still in the batch at the end."""

    outputs: dict[int, list]
    third_joined_at: int
    open_streams: set[int]


def run_joining(
    batch, start: Callable[[int], int], summary: Callable, second_at: int, limit: int
) -> JoinedRun:
    """Runs streams 0 (from step 0), 1 (from `second_at`) and 2 (from the step after stream 0
    finishes) in `batch` until stream 2 finishes; `start(stream)` adds a stream and returns its
    row, `summary(out)` is what a step's output records. Fails past `limit` steps."""
    row_of: dict[int, int] = {}  # stream -> row
    outputs: dict[int, list] = {stream: [] for stream in range(3)}
    join_at = {0: 0, 1: second_at}
    step = 0
    while not outputs[2] or 2 in row_of:
        for stream, at in join_at.items():
            if at == step:
                row_of[stream] = start(stream)
        stream_of = {row: stream for stream, row in row_of.items()}
        for out in batch.step():
            stream = stream_of[out.row]
            outputs[stream].append(summary(out))
            if out.finished:
                batch.remove(out.row)
                del row_of[stream]
                if stream == 0:
                    join_at[2] = step + 1
        step += 1
        assert step < limit
    return JoinedRun(outputs, join_at[2], set(row_of))
