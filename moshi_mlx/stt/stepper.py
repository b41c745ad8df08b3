"""Batched steps of a model without a depformer (Kyutai's STT): audio codes in, text out.

Step semantics follow Kyutai's PyTorch `LMGen` with `dep_q` 0: at step t the audio codes of
every stream k are written `delays[k]` steps ahead in a delayed-token buffer; the step feeds column t
(each stream's start token while t <= its delay), samples the text token and writes it at
t + 1; once t + 1 > max_delay it returns the text token `max_delay - delays[0]` steps back.
All B streams of a batch step together, so one read of the weights serves them all; each
stream's text and head probabilities are its own.

The step (`SttStepFunction.step`, run by `SttStepper` on `moshi_mlx.runtime.stepper`) is a
pure function, `StepState` (delayed tokens, random key, KV ring) and the codes in, `StepOutput`
out. `SttStepper.step` returns lazy arrays with their evaluation queued; the caller reads
them. Rows whose streams started at different steps (`SttBatch`, `Stepper.start_row`) carry
their start positions in the state: each row's own step decides its start tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import MoshiError, removed_names
from moshi_mlx.models.lm import Lm
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import GREEDY, Sampling, gumbel_noise, split_key
from moshi_mlx.runtime.step_state import StepOutput, StepState
from moshi_mlx.runtime.stepper import StepFunction, Stepper


class SttStepFunction(StepFunction):
    """The STT's step for one model and text sampling (see the module docstring)."""

    def __init__(self, lm: Lm, text_sampling: Sampling):
        super().__init__(lm)
        self.text_sampling = text_sampling

    def step(self, state: StepState, codes: mx.array) -> StepOutput:
        """The state (delayed tokens (B, K, width), random key, KV ring) and the audio codes
        (B, n_q) -> the next state, the text tokens out (B,), the step's inputs (B, K), the
        text logits (B, text_card) and the heads' probabilities (B, heads, classes)."""
        lm, config, delayed, t = self.lm, self.lm.config, self.delayed_tokens, state.position
        audio = (codes, slice(1, None), 0)  # read as its write leaves it (`column`)
        tokens = delayed.write_delayed(state.tokens, t, *audio[:2])
        if state.starts is None:
            inputs = delayed.inputs(state.tokens, t, audio)  # (B, K)
        else:  # each row's own step decides its start tokens
            steps = (t - state.starts)[:, None]
            column = delayed.column(state.tokens, t, fresh=audio)
            inputs = mx.where(steps <= delayed.delays, delayed.start_tokens, column)
        kv = self.kv_ring(state)
        temporal_out, text_logits = lm.step_text(inputs, kv)
        key, noise = state.key, None
        if self.text_sampling.draws:  # a greedy step draws nothing: its key stays
            key, text_key = split_key(state.key)
            noise = gumbel_noise(text_logits.shape, text_key)
        text = self.text_sampling.sample_column(text_logits, noise)  # (B, 1)
        tokens = delayed.write_column(tokens, kv.next_position, text, slice(0, 1))
        out = delayed.frame_out(tokens, t, 0)  # (B,)
        heads = (
            lm.head_probabilities(temporal_out)
            if config.extra_heads_num_heads
            else mx.zeros((codes.shape[0], 0, 0), mx.float32)
        )
        next_state = StepState.of(tokens, key, kv.advanced())
        return StepOutput(
            next_state, out, None, inputs, text_logits=text_logits, head_probabilities=heads
        )


class SttStepper(Stepper):
    """Steps `batch` streams of a model without a depformer (Kyutai's STT) together.

    Args:
        lm: the model (`dep_q` 0).
        batch: the streams stepped together.
        text_sampling: how the text is drawn (default greedy, as Kyutai's STT).
        seed: the random stream's seed.
        compiled_steps: the model's `ModelMemo` of compiled steps, shared with the other
            steppers given it (None: this stepper compiles its own).
    """

    def __init__(
        self,
        lm: Lm,
        batch: int = 1,
        text_sampling: Sampling | None = None,
        seed: int = 0,
        compiled_steps: ModelMemo[SttStepFunction] | None = None,
    ):
        if lm.config.dep_q:
            raise MoshiError("SttStepper runs models without a depformer (dep_q 0)")
        self.batch = batch
        self.seed = seed
        function = SttStepFunction.shared(lm, compiled_steps, (text_sampling or GREEDY,))
        super().__init__(function, self._fresh(function))

    def _fresh(self, function: SttStepFunction) -> StepState:
        tokens = function.delayed_tokens.empty(self.batch)
        return StepState.of(tokens, mx.random.key(self.seed), function.lm.make_ring(self.batch))

    def reset(self) -> None:
        """Start every stream over (the seed's random stream too)."""
        self._state, self.step_index = self._fresh(self.function), 0

    def _codes(self, codes: np.ndarray | mx.array) -> mx.array:
        codes = mx.array(codes).astype(mx.int32) if not isinstance(codes, mx.array) else codes
        expected = (self.batch, self.lm.config.n_q)
        if codes.shape != expected:
            raise MoshiError(f"expected audio codes of shape {expected}, got {codes.shape}")
        return codes.astype(mx.int32)

    def step_graph(self, codes: np.ndarray | mx.array, compiled: bool = True) -> StepOutput:
        """`Stepper.graph` of the next step with these codes."""
        return self.graph(self._codes(codes), compiled=compiled)

    def step(self, codes: np.ndarray | mx.array) -> StepOutput:
        """Advance all streams by one frame of audio codes (B, n_q), lazily: `text` (B,) the
        text tokens out (meaningful once `ready`), `text_logits` (B, text_card) of the
        tokens sampled now, `head_probabilities` (B, heads, classes) (no heads: (B, 0, 0))."""
        return self._run(self._codes(codes))


__getattr__ = removed_names(
    __name__,
    {
        "ListenStepper": "ListenStepper is now SttStepper (moshi_mlx.stt.stepper)",
        "ListenStepFunction": "ListenStepFunction is now SttStepFunction (moshi_mlx.stt.stepper)",
        "ListenStep": "ListenStep is now StepOutput (moshi_mlx.runtime.step_state), what "
        "SttStepper.step returns",
        "TextSampling": "TextSampling is now Sampling (moshi_mlx.runtime.sampling)",
    },
)
