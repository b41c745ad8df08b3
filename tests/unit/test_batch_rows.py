"""`moshi_mlx.runtime.batch_rows.BatchRows`: the free-row rule of `SttBatch` and `TtsBatch`."""

from __future__ import annotations

import pytest

from moshi_mlx.errors import MoshiError, TtsError
from moshi_mlx.runtime.batch_rows import BatchRows


def test_the_first_free_row_is_taken_and_a_freed_row_comes_back():
    rows: BatchRows[str] = BatchRows(3)
    for name in "abc":
        rows[rows.free_row()] = name
    assert rows == {0: "a", 1: "b", 2: "c"}
    del rows[1]
    assert rows.free_row() == 1
    assert rows.stream(2) == "c"


@pytest.mark.parametrize("error", [MoshiError, TtsError])
def test_errors_are_the_products(error):
    with pytest.raises(error, match="^a batch has at least one row, not 0$"):
        BatchRows(0, error)
    rows: BatchRows[str] = BatchRows(1, error)
    rows[rows.free_row()] = "a"
    with pytest.raises(error, match="^all 1 rows of the batch are busy$"):
        rows.free_row()
    with pytest.raises(error, match="^row 5 holds no stream$"):
        rows.stream(5)
    rows.release(0)
    assert not rows
    with pytest.raises(error, match="^row 0 holds no stream$"):
        rows.release(0)
