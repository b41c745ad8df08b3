import mlx.core as mx
import pytest
from mlx import nn

from moshi_mlx.modules.embeddings import StackedTables, TokenEmbedding
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.modules.step_tricks import lookup_column


def _tables(quantized: bool, count: int = 3, first_rows: int = 17) -> list[nn.Module]:
    mx.random.seed(5)
    tables = []
    for k in range(count):
        table = nn.Embedding(first_rows if k == 0 else 17, 64)
        table.set_dtype(mx.bfloat16)
        tables.append(nn.QuantizedEmbedding.from_embedding(table, 32, 4) if quantized else table)
    return tables


@pytest.mark.parametrize("quantized", [False, True])
def test_stacked_tables_look_up_as_each_table(quantized):
    """A token of each table in one lookup (one gather per part and, quantized, one
    dequantization) gives each table's own vectors, bit for bit, and -1 ("no input") a zero
    vector, for several positions (B, count, T) or one (B, count); tables of one width stack
    whatever their rows; the tables then read views of the stack until a part is replaced."""
    tables = _tables(quantized, first_rows=40)
    tokens = mx.array([[[0, 39], [16, -1], [5, 2]], [[-1, 3], [3, 0], [9, 16]]])  # (B, count, T)

    def expected_of(tokens: mx.array) -> mx.array:
        looked_up = [table(mx.maximum(tokens[:, k], 0)) for k, table in enumerate(tables)]
        return mx.where((tokens < 0)[..., None], 0, mx.stack(looked_up, axis=1))

    expected = expected_of(tokens)
    stack = StackedTables.of(tables)
    mx.eval(stack.flat)
    assert set(stack.flat) == ({"weight", "scales", "biases"} if quantized else {"weight"})
    got = stack(tokens)
    assert got.shape == (2, 3, 2, 64) and mx.array_equal(got, expected).item()
    one = tokens[:, :, 1]
    assert mx.array_equal(stack(one), expected_of(one)).item()
    assert stack.holds(tables)
    after = expected_of(tokens)
    assert mx.array_equal(after, expected).item()
    part = "scales" if quantized else "weight"
    tables[1][part] = tables[1][part] + 0
    assert not stack.holds(tables)


def test_tables_that_differ_do_not_stack():
    plain, quantized = _tables(False, 1), _tables(True, 1)
    assert StackedTables.of(plain + quantized) is None
    assert StackedTables.of([]) is None
    assert StackedTables.of(plain + [nn.Embedding(17, 32)]) is None
    other_bits = nn.QuantizedEmbedding.from_embedding(nn.Embedding(17, 64), 32, 8)
    assert StackedTables.of(quantized + [other_bits]) is None


def _token_embedding(quantized: bool, demux: bool) -> TokenEmbedding:
    mx.random.seed(6)
    table = TokenEmbedding(33, 64, low_rank=64, demux=demux)
    table.update({"weight": mx.random.normal((33, 64))})
    table.set_dtype(mx.bfloat16)
    if quantized:
        table.quantize_table(32, 8)
    return table


@pytest.mark.parametrize(
    "make",
    [
        lambda: _tables(False, 1)[0],
        lambda: _tables(True, 1)[0],
        lambda: _token_embedding(False, False),
        lambda: _token_embedding(True, False),
        lambda: _token_embedding(True, True),
    ],
    ids=["plain", "quantized", "low-rank", "low-rank-quantized", "demux-quantized"],
)
def test_lookup_column_equals_the_lookup(make):
    """A column of tokens (B, 1) looked up along the table's rows (a quantized table's
    packed rows, scales and biases alike) gives its lookup's vectors, bit for bit."""
    table = make()
    column = mx.array([[0], [16], [7]])
    got = lookup_column(table, column)
    assert got.shape == (3, 64) and mx.array_equal(got, table(column[:, 0])).item()


@pytest.mark.parametrize("demux", [False, True])
def test_quantized_low_rank_table_dequantized_once_for_the_step(demux):
    """`transpose_weights` dequantizes a quantized low-rank table once (the same values its
    lookups gave, bit for bit, by token and by column); a replaced table is looked up
    quantized again; other tables are left as they are."""
    table = _token_embedding(True, demux)
    tokens = mx.array([0, 32, 70, 9] if demux else [0, 32, 9])  # demux: 70 packs 4 and 1
    column = mx.array([[0], [16], [7]])
    before = table(tokens), lookup_column(table, column)
    mx.eval(transpose_weights(table))
    assert table.step_table().dtype == mx.bfloat16 and table.step_table().shape == (33, 64)
    after = table(tokens), lookup_column(table, column)
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, before))
    table.weight = table.weight + 0  # replaced
    assert table.step_table() is None
    assert _token_embedding(False, demux).transpose_weight() is None
