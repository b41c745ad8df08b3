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

import mlx.core as mx
from mlx import nn

from moshi_mlx.modules.step_tricks import StepWeight


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
