"""A `Linear` layer whose step graphs hold no transpose of its weight.

MLX's `nn.Linear` computes `x @ weight.T`: every call adds a `Transpose` operation to the
graph (a view, no copy, but one more operation to schedule; on the CPU a matmul with it costs
about twice one without). A compiled step calls some 1,000 linears per TTS frame, so
`transpose_weights` makes each layer's transposed view once, for the caller to evaluate before
it traces a step: the graph then reads the evaluated view, with the same strides and so the
same numbers. A layer whose weight was replaced since (loading, quantizing turns it into
another class) computes `x @ weight.T` again until the next `transpose_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn


@dataclass(frozen=True)
class _Transposed:
    source: mx.array  # the weight the view was made of
    view: mx.array  # source.T


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same numbers), reading its weight's transposed view
    when `transpose_weights` made one."""

    def __call__(self, x: mx.array) -> mx.array:
        transposed = self.__dict__.get("_transposed")
        if transposed is None or transposed.source is not self.weight:
            return super().__call__(x)
        if "bias" in self:
            return mx.addmm(self.bias, x, transposed.view)
        return x @ transposed.view

    def transposed_weight(self) -> mx.array:
        """Make (or keep) the weight's transposed view; the caller evaluates it."""
        transposed = self.__dict__.get("_transposed")
        if transposed is None or transposed.source is not self.weight:
            transposed = _Transposed(self.weight, self.weight.T)
            object.__setattr__(self, "_transposed", transposed)
        return transposed.view


def transpose_weights(model: nn.Module) -> list[mx.array]:
    """Each `Linear` of `model` reads its weight through a transposed view from now on (the
    views returned, to be evaluated before a step is traced; shared layers once)."""
    views = {}
    for _, module in model.named_modules():
        if isinstance(module, Linear):
            views[id(module)] = module.transposed_weight()
    return list(views.values())
