"""The stepper every product steps on: a model's pure step, compiled once, and its state.

A product (chat, STT, TTS) writes one pure function, `StepFunction.step(state, *inputs) ->
StepOutput` (`moshi_mlx.runtime.step_state`): arrays in, arrays out, nothing waited for. The
`StepFunction` compiles it (one trace per KV capacity bucket and variant, not per step) after
`transpose_weights`, and is made once per model and choice (sampling, KV layout...) and
kept in the model's `ModelMemo`, so a warm-up's traces serve later streams. A `Stepper`
owns one stream's (or batch's) `StepState` and step index: before each step it grows the KV
ring to the step's bucket, then runs the compiled step, keeps the next state, queues the
outputs' evaluation (`mx.async_eval`) and hands them back without the state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import mlx.core as mx
from typing_extensions import Self

from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.runtime.delayed_tokens import UNGENERATED, DelayedTokens
from moshi_mlx.runtime.model_memo import MAX_STEP_FUNCTIONS, ModelMemo, model_memo
from moshi_mlx.runtime.step_state import StepOutput, StepState

Function = TypeVar("Function", bound="StepFunction")


class StepFunction:
    """A model's pure step for one choice (sampling, KV layout, ...), and `compiled`, the
    same through `mx.compile`. Subclasses take the model, then their choice, and write
    `step`; `shared` finds or makes the one of a model's `ModelMemo`."""

    def __init__(self, lm: Lm, kv_quantization: KVQuantization | None = None):
        self.lm = lm
        self.kv_quantization = kv_quantization  # None: keys and values in the compute dtype
        self.delayed_tokens = DelayedTokens.of(lm.config)
        mx.eval(transpose_weights(lm))  # no weight transposes in the traced steps
        self.compiled: Callable[..., StepOutput] = mx.compile(self.step)

    @classmethod
    def shared(
        cls,
        lm: Lm,
        memo: ModelMemo | None,
        choice: tuple[Hashable, ...],
        size: int | None = MAX_STEP_FUNCTIONS,
    ) -> Self:
        """The step of `lm` and `choice` (the constructor's arguments after the model) that
        `memo` (`lm`'s; None: a fresh one of `size`) keeps, else made and kept there."""
        return model_memo(lm, memo, size).get(choice, lambda: cls(lm, *choice))

    def step(self, state: StepState, *inputs: mx.array, **variant: object) -> StepOutput:
        """The state and the step's inputs -> the next state and the step's tokens, lazily.
        `variant`: constants that choose another trace (e.g. the TTS's depformer on or off)."""
        raise NotImplementedError

    def kv_ring(self, state: StepState) -> KVRing:
        """The temporal transformer's `KVRing` of `state`."""
        return state.ring(self.lm.config.attention_window, self.kv_quantization)


class Stepper:
    """One stream's (or one batch's) state over a `StepFunction`: `step` advances it by one
    frame. The step index counts the steps taken; `ready` says when frames come out."""

    def __init__(self, function: StepFunction, state: StepState, step_index: int = 0):
        self.function = function
        self.lm = function.lm
        self._state = state
        self.step_index = step_index

    @property
    def ring(self) -> KVRing:
        """The temporal transformer's `KVRing` as the last step left it."""
        return self.function.kv_ring(self._state)

    @property
    def kv_quantization(self) -> KVQuantization | None:
        """How the KV ring stores keys and values (None: in the compute dtype)."""
        return self.function.kv_quantization

    @property
    def ready(self) -> bool:
        """Whether the last step gave out a frame (the delays are filled)."""
        return self.step_index > self.lm.config.max_delay

    def reserve(self, positions: int) -> None:
        """Give the KV ring room for `positions` steps now (at most the context), so that no
        later step pays for growing it; every step then attends over the whole room."""
        self._state = self._state.with_ring(self.ring.grown(max(positions, 1) - 1))

    def start_row(self, row: int) -> None:
        """Start a new stream in batch row `row` at the next step: its delayed tokens emptied, the
        KV positions it wrote before forgotten (masked: `KVRing.with_row_started`)."""
        tokens = self._state.tokens
        rows = (mx.arange(tokens.shape[0]) == row).reshape(-1, *([1] * (tokens.ndim - 1)))
        tokens = mx.where(rows, mx.array(UNGENERATED, mx.int32), tokens)
        self._state = self._state._replace(tokens=tokens).with_ring(self.ring.with_row_started(row))
        mx.eval(self._state.tokens, self._state.starts)

    def graph(self, *inputs: mx.array, compiled: bool = True, **variant: object) -> StepOutput:
        """The lazy output (tokens and next state) of the next step, without taking it: its
        graph as the compiled function replays it, or as Python builds it without `mx.compile`
        (to inspect, e.g. with `mx.export_to_dot`)."""
        function = self.function.compiled if compiled else self.function.step
        return self._next(function, inputs, variant)

    def _run(self, *inputs: mx.array, **variant: object) -> StepOutput:
        """Take the next step with these inputs: returns at once (lazy outputs, their
        evaluation queued), the state left out."""
        out = self._next(self.function.compiled, inputs, variant)
        # No reference to the old state's KV buffers may outlive this line: MLX then writes
        # the new position into them in place instead of copying the whole ring each step.
        self._state = out.state
        mx.async_eval(out)
        self.step_index += 1
        return out._replace(state=None)

    def _next(
        self, function: Callable[..., StepOutput], inputs: tuple, variant: dict
    ) -> StepOutput:
        """The next step's output: the ring grown to its bucket first (held by the state
        alone, so the old buffers go)."""
        self._state = self._state.with_ring(self.ring.grown(self.step_index))
        return function(self._state, *inputs, **variant)
