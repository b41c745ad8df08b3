import mlx.core as mx
import pytest
from mlx import nn

from moshi_mlx.modules.linear import Linear, StackedLinears
from moshi_mlx.modules.step_tricks import split_last


def _linears(quantized: bool, widths=(32, 48, 32)) -> list[nn.Module]:
    mx.random.seed(3)
    linears = []
    for width in widths:
        linear = Linear(64, width, bias=False)
        linear.set_dtype(mx.bfloat16)
        linears.append(nn.QuantizedLinear.from_linear(linear, 32, 4) if quantized else linear)
    return linears


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_stacked_linears_give_each_linears_output(quantized, batch):
    """One product of the stack, split, gives each linear's own output, bit for bit; the
    linears then read views of the stack (the same outputs) until a part is replaced."""
    linears = _linears(quantized)
    x = mx.random.normal((batch, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    expected = [linear(x) for linear in linears]
    stack = StackedLinears.of(linears)
    mx.eval(stack.arrays)
    outputs = stack(x)
    assert stack.exact_for(x) == (batch == 1)
    assert [out.shape[-1] for out in outputs] == [32, 48, 32]
    assert all(mx.array_equal(a, b).item() for a, b in zip(outputs, expected))
    assert stack.holds(linears)
    assert all(mx.array_equal(linear(x), b).item() for linear, b in zip(linears, expected))
    part = "scales" if quantized else "weight"
    linears[2][part] = linears[2][part] + 0
    assert not stack.holds(linears)


def test_linears_that_differ_do_not_stack():
    plain, quantized = _linears(False, (32,)), _linears(True, (32,))
    assert StackedLinears.of(plain + quantized) is None
    assert StackedLinears.of(plain + [Linear(64, 32, bias=True)]) is None
    assert StackedLinears.of(plain + [Linear(32, 32, bias=False)]) is None
    other_bits = nn.QuantizedLinear.from_linear(Linear(64, 32, bias=False), 32, 8)
    assert StackedLinears.of(quantized + [other_bits]) is None


@pytest.mark.parametrize("parts", [1, 3, 10, 11, 25])
def test_split_last_equals_mlx_split(parts):
    """More parts than one MLX split takes are split in groups, the same parts."""
    x = mx.arange(2 * 100).reshape(2, 100)
    starts = [4 * k for k in range(1, parts)]
    got, expected = split_last(x, starts), mx.split(x, starts, axis=-1)
    assert len(got) == parts and all(mx.array_equal(a, b).item() for a, b in zip(got, expected))
