"""The rows of a batch of streams that come and go (`SttBatch`, `TtsBatch`): `BatchRows`."""

from __future__ import annotations

from typing import Generic, TypeVar

from moshi_mlx.errors import MoshiError

Row = TypeVar("Row")


class BatchRows(dict[int, Row], Generic[Row]):
    """A batch's `size` rows: the busy ones map to their stream's state, the others are free.
    Its errors are of type `error` (the product's: `TtsError`, `MoshiError`)."""

    def __init__(self, size: int, error: type[MoshiError] = MoshiError):
        if size < 1:
            raise error(f"a batch has at least one row, not {size}")
        super().__init__()
        self.size = size
        self.error = error

    def free_row(self) -> int:
        """The first free row; `error` when every row is busy."""
        for row in range(self.size):
            if row not in self:
                return row
        raise self.error(f"all {self.size} rows of the batch are busy")

    def stream(self, row: int) -> Row:
        """The state of `row`'s stream; `error` when it holds none."""
        if row not in self:
            raise self.error(f"row {row} holds no stream")
        return self[row]

    def release(self, row: int) -> None:
        """Free `row`; `error` when it holds no stream."""
        self.stream(row)
        del self[row]
