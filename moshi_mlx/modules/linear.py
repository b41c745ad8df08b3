"""A `Linear` layer whose step graphs hold no transpose of its weight.

MLX's `nn.Linear` computes `x @ weight.T`: every call adds a `Transpose` operation to the
graph (a view, no copy, but one more operation to schedule; on the CPU a matmul with it costs
about twice one without). A compiled step calls some 1,000 linears per TTS frame, so
`transpose_weights` gives each layer its `transposed` weight (a `StepWeight`,
`moshi_mlx.modules.step_tricks`), a view
made once, for the caller to evaluate before it traces a step: the graph then reads the
evaluated view, with the same strides and so the same numbers. A layer whose weight was
replaced since (loading; quantizing turns it into another class) computes `x @ weight.T`
again until the next `transpose_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from moshi_mlx.modules.step_tricks import QUANTIZED_PARTS, Quantization, StepWeight, split_last


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same numbers), reading its `transposed` weight when it
    has one made of its current weight."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True):
        super().__init__(input_dims, output_dims, bias)
        # Not a parameter (a plain attribute): set by `transpose_weights`, never saved.
        self.transposed: StepWeight | None = None

    def __call__(self, x: mx.array) -> mx.array:
        transposed = StepWeight.current(self.transposed, self.weight)
        if transposed is None:
            return super().__call__(x)
        if "bias" in self:
            return mx.addmm(self.bias, x, transposed)
        return x @ transposed

    def transpose_weight(self) -> mx.array:
        """Make (or keep) `transposed` of the current weight; its view, for the caller to
        evaluate."""
        self.transposed = StepWeight.kept(self.transposed, self.weight, lambda weight: weight.T)
        return self.transposed.view


def transpose_weights(model: nn.Module) -> list[mx.array]:
    """Each `Linear` of `model`, and each module with a `transpose_weight` method of its
    own (the cross-attention's queries; the LM's stacked audio tables; the RMSNorms'
    float32 weights), reads its weight through a view made for the step from now on (the
    views returned, to be evaluated before a step is traced; shared layers once)."""
    views = {}
    for _, module in model.named_modules():
        if isinstance(module, Linear) or callable(getattr(module, "transpose_weight", None)):
            views[id(module)] = module.transpose_weight()  # a view, a list of them, or None
    return [
        view
        for made in views.values()
        for view in (made if isinstance(made, list) else [made])
        if view is not None
    ]


@dataclass(frozen=True)
class StackedLinears:
    """Linears without bias of one input width (`Linear`s, or `nn.QuantizedLinear`s quantized
    alike) as one: their weights' rows one after the other in one array per part (`weight`; a
    quantized one's `scales` and `biases`), whose row ranges the linears' parts are views of
    (no memory added once evaluated). A step computes every linear's output of one input in
    one product and one split, not one product each; each output column is the same dot
    product as the linear's own."""

    flat: dict[str, mx.array]  # part name -> (outputs of every linear, ...)
    views: tuple[dict[str, mx.array], ...]  # per linear, part name -> its rows of `flat`
    transposed: mx.array | None  # a plain stack's (in, out) view of its weight
    quantization: Quantization | None  # group size, bits, mode
    starts: tuple[int, ...]  # each linear's first output, after the first linear's

    @classmethod
    def of(cls, linears: Sequence[nn.Module]) -> StackedLinears | None:
        """Stack `linears`, their parts replaced by views of the stack (lazy: the caller
        evaluates `arrays`); None unless they are `Linear`s without bias of one input width
        and dtype, or `nn.QuantizedLinear`s without bias quantized alike."""
        kinds = {type(linear) for linear in linears}
        if kinds not in ({Linear}, {nn.QuantizedLinear}) or any("bias" in l for l in linears):
            return None
        quantized = kinds == {nn.QuantizedLinear}
        quantization = {
            (linear.group_size, linear.bits, linear.mode) if quantized else None
            for linear in linears
        }
        names = [name for name in QUANTIZED_PARTS if name in linears[0]]
        widths = {tuple((l[name].shape[1:], l[name].dtype) for name in names) for l in linears}
        if len(quantization) != 1 or len(widths) != 1:
            return None
        starts = np.cumsum([0] + [linear.weight.shape[0] for linear in linears])
        flat = {name: mx.concatenate([linear[name] for linear in linears]) for name in names}
        views = tuple(
            {name: part[starts[k] : starts[k + 1]] for name, part in flat.items()}
            for k in range(len(linears))
        )
        for linear, linear_views in zip(linears, views):
            linear.update(linear_views)
        transposed = None if quantized else flat["weight"].T
        return cls(flat, views, transposed, quantization.pop(), tuple(starts[1:-1].tolist()))

    @property
    def arrays(self) -> list[mx.array]:
        """The stack's arrays, for the caller to evaluate."""
        return [*self.flat.values(), *([] if self.transposed is None else [self.transposed])]

    def holds(self, linears: Sequence[nn.Module]) -> bool:
        """Whether `linears`' parts are still this stack's views (none was replaced)."""
        return len(linears) == len(self.views) and all(
            linear.get(name) is view
            for linear, linear_views in zip(linears, self.views)
            for name, view in linear_views.items()
        )

    @staticmethod
    def exact_for(x: mx.array) -> bool:
        """Whether the stack's product of x gives the linears' own numbers on every backend:
        for one row (a matrix-vector product, each output summed along the input in an order
        that does not depend on the outputs' count). Products of several rows may be tiled
        (split along the input) by the outputs' count on a GPU (cuBLASLt, Metal's GEMM)."""
        return x.size == x.shape[-1]

    def product(self, x: mx.array) -> mx.array:
        """The linears' outputs of x (..., in) side by side (..., sum of their outputs)."""
        if self.quantization is None:
            return x @ self.transposed
        group_size, bits, mode = self.quantization
        return mx.quantized_matmul(
            x,
            self.flat["weight"],
            scales=self.flat["scales"],
            biases=self.flat.get("biases"),
            transpose=True,
            group_size=group_size,
            bits=bits,
            mode=mode,
        )

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each linear's output of x (..., in), in the stack's order."""
        return split_last(self.product(x), list(self.starts))
