"""Batched steps of a model without a depformer (Kyutai's STT): audio codes in, text out.

Step semantics follow Kyutai's PyTorch `LMGen` with `dep_q` 0: at step t the audio codes of
every stream k are written `delays[k]` steps ahead in a token ring; the step feeds column t
(each stream's start token while t <= its delay), samples the text token and writes it at
t + 1; once t + 1 > max_delay it returns the text token `max_delay - delays[0]` steps back.
All B streams of a batch step together, so one read of the weights serves them all; each
stream's text and head probabilities are its own.

A step is one `mx.compile`d function, `StepState` (token ring, random key, KV ring) and the
codes in, `StepOutput` out (`moshi_mlx.runtime.step_state`), traced once per KV capacity
bucket and shared by the steppers of one sampling given the model's `ModelCache`.
`ListenStepper.step` returns lazy arrays with their evaluation queued; the caller reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import MoshiError
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.runtime.model_cache import ModelCache, model_cache
from moshi_mlx.runtime.sampling import sample
from moshi_mlx.runtime.step_state import StepOutput, StepState
from moshi_mlx.runtime.token_ring import TokenRing


@dataclass(frozen=True)
class TextSampling:
    """How the text token is chosen (temperature 0: greedy, as Kyutai's STT runs)."""

    temp: float = 0.0
    top_k: int = 0


@dataclass(frozen=True)
class ListenStep:
    """One step's lazy outputs: text_tokens (B,) (meaningful once the stepper is `ready`),
    text_logits (B, text_card) of the token sampled now, head_probabilities (B, heads,
    classes) (no heads: (B, 0, 0))."""

    text_tokens: mx.array
    text_logits: mx.array
    head_probabilities: mx.array


class ListenStepFunction:
    """The compiled step of one model and sampling (see the module docstring); `rows`, the
    same for rows whose streams started at different steps (`SttBatch`: their start
    positions (B,) after the state)."""

    def __init__(self, lm: Lm, sampling: TextSampling):
        self.lm = lm
        self.sampling = sampling
        self.ring = TokenRing.of(lm.cfg)
        mx.eval(transpose_weights(lm))  # no weight transposes in the traced steps
        self.compiled = mx.compile(self.step)
        self.rows = mx.compile(lambda state, starts, codes: self.step(state, codes, starts))

    def step(self, state: StepState, codes: mx.array, starts: mx.array | None = None) -> StepOutput:
        """The state (token ring (B, K, width), random key, KV ring) and the audio codes
        (B, n_q) -> the next state, the text tokens out (B,), the step's inputs (B, K), the
        text logits (B, text_card) and the heads' probabilities (B, heads, classes).
        `starts` (B,): the position each row's stream started at (None: all at 0)."""
        lm, cfg, ring, t = self.lm, self.lm.cfg, self.ring, state.position
        tokens = ring.write_delayed(state.tokens, t, codes, slice(1, None))
        if starts is None:
            inputs = ring.inputs(tokens, t)  # (B, K)
        else:  # each row's own step decides its start tokens
            steps = (t - starts)[:, None]
            inputs = mx.where(steps <= ring.delays, ring.start_tokens, ring.column(tokens, t))
        kv = state.ring(cfg.attention_window).with_starts(starts)
        temporal_out, text_logits = lm.step_text(inputs[:, :, None], kv)
        key, text_key = mx.random.split(state.key)
        text = sample(text_logits, self.sampling.temp, self.sampling.top_k, text_key)
        tokens = ring.write_column(tokens, t + 1, text[:, None], slice(0, 1))
        out = ring.frame_out(tokens, t, slice(0, 1))[:, 0]
        heads = (
            lm.head_probabilities(temporal_out)
            if cfg.extra_heads_num_heads
            else mx.zeros((codes.shape[0], 0, 0), mx.float32)
        )
        next_state = StepState.of(tokens, key, kv.advanced())
        return StepOutput(
            next_state, out, None, inputs, text_logits=text_logits, head_probabilities=heads
        )


class ListenStepper:
    """Steps `batch` streams of a model without a depformer together; `reset` starts over.
    `step_cache`, the model's `ModelCache` of compiled steps, shares their traces with the
    other steppers given it (None: this stepper compiles its own)."""

    def __init__(
        self,
        lm: Lm,
        batch: int = 1,
        sampling: TextSampling | None = None,
        seed: int = 0,
        step_cache: ModelCache[ListenStepFunction] | None = None,
    ):
        if lm.cfg.dep_q:
            raise MoshiError("ListenStepper runs models without a depformer (dep_q 0)")
        self.lm = lm
        self.batch = batch
        self.seed = seed
        sampling = sampling or TextSampling()
        cache = model_cache(lm, step_cache)
        self._function = cache.get(sampling, lambda: ListenStepFunction(lm, sampling))
        self.reset()

    def reset(self) -> None:
        tokens = self._function.ring.empty(self.batch)
        key = mx.random.key(self.seed)
        self._state = StepState.of(tokens, key, self.lm.make_ring(self.batch))
        self.step_index = 0

    @property
    def ring(self) -> KVRing:
        """The temporal transformer's `KVRing` as the last step left it."""
        return self._state.ring(self.lm.cfg.attention_window)

    def reserve(self, positions: int) -> None:
        """Give the KV ring room for `positions` steps now (at most the context), so that no
        later step pays for growing it; every step then attends over the whole room."""
        self._state = self._state.with_ring(self.ring.grown(max(positions, 1) - 1))

    @property
    def ready(self) -> bool:
        """Whether the last step returned text (the delays are filled)."""
        return self.step_index > self.lm.cfg.max_delay

    def _codes(self, codes: np.ndarray | mx.array) -> mx.array:
        codes = mx.array(codes).astype(mx.int32) if not isinstance(codes, mx.array) else codes
        expected = (self.batch, self.lm.cfg.n_q)
        if codes.shape != expected:
            raise MoshiError(f"expected audio codes of shape {expected}, got {codes.shape}")
        return codes.astype(mx.int32)

    def step_graph(self, codes: np.ndarray | mx.array, compiled: bool = True) -> StepOutput:
        """The lazy output (text and next state) of the next step, without taking it: its
        graph as the compiled function replays it, or as Python builds it without `mx.compile`
        (to inspect, e.g. with `mx.export_to_dot`)."""
        function = self._function.compiled if compiled else self._function.step
        state = self._state.with_ring(self.ring.grown(self.step_index))
        return function(state, self._codes(codes))

    def step(self, codes: np.ndarray | mx.array) -> ListenStep:
        """Advance all streams by one frame of audio codes (B, n_q), lazily."""
        codes = self._codes(codes)
        self._state = self._state.with_ring(self.ring.grown(self.step_index))
        out = self._function.compiled(self._state, codes)
        # No reference to the old state's KV buffers may outlive this line: MLX then writes
        # the new position into them in place instead of copying the whole ring each step.
        self._state = out.state
        mx.async_eval(out.text, out.head_probabilities, out.state)
        self.step_index += 1
        return ListenStep(out.text, out.text_logits, out.head_probabilities)
