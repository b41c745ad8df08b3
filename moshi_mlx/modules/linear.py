"""A `Linear` layer whose step graphs hold no transpose of its weight.

MLX's `nn.Linear` computes `x @ weight.T`: every call adds a `Transpose` operation to the
graph (a view, no copy, but one more operation to schedule; on the CPU a matmul with it costs
about twice one without). A compiled step calls some 1,000 linears per TTS frame, so
`transpose_weights` gives each layer its `transposed` weight (`StepWeight`), a view
made once, for the caller to evaluate before it traces a step: the graph then reads the
evaluated view, with the same strides and so the same numbers. A layer whose weight was
replaced since (loading; quantizing turns it into another class) computes `x @ weight.T`
again until the next `transpose_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

QUANTIZED_PARTS = ("weight", "scales", "biases")  # a quantized layer's arrays (MLX's names)


@dataclass(frozen=True)
class StepWeight:
    """A weight and the form a step reads it in, made once: a Linear's transposed view
    (in, out) of its weight (out, in), a norm's float32 copy (`transformer.RMSNorm`), a
    dequantized table, a quantized linear's query rows (a dict of its parts)."""

    weight: mx.array
    view: Any

    @staticmethod
    def kept(
        made: StepWeight | None, weight: mx.array, make: Callable[[mx.array], Any]
    ) -> StepWeight:
        """`made` while it is of `weight` (the same array), else one of `make(weight)`."""
        if made is not None and made.weight is weight:
            return made
        return StepWeight(weight, make(weight))

    @staticmethod
    def current(made: StepWeight | None, weight: mx.array | None) -> Any:
        """`made`'s view while it is of `weight`, else None (the weight was replaced since:
        loading, quantizing)."""
        return made.view if made is not None and made.weight is weight else None


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
