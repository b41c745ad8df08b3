"""Batched steps of a model without a depformer (Kyutai's STT): audio codes in, text out.

Step semantics follow Kyutai's PyTorch `LMGen` with `dep_q` 0: at step t the audio codes of
every stream k are written `delays[k]` steps ahead in a token ring; the step feeds column t
(each stream's start token while t <= its delay), samples the text token and writes it at
t + 1; once t + 1 > max_delay it returns the text token `max_delay - delays[0]` steps back.
All B streams of a batch step together, so one read of the weights serves them all; each
stream's text and head probabilities are its own.

A step is one `mx.compile`d function of arrays (codes, token ring, random key, KV ring),
traced once per KV capacity bucket and shared by the steppers of one model and sampling.
`ListenStepper.step` returns lazy arrays with their evaluation queued; the caller reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import MoshiError
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.runtime.sampling import sample
from moshi_mlx.runtime.token_ring import UNGENERATED


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


class _StepFunction:
    """The compiled step of one model and sampling (see the module docstring)."""

    def __init__(self, lm: Lm, sampling: TextSampling):
        cfg = lm.cfg
        self.lm = lm
        self.sampling = sampling
        self.width = cfg.max_delay + 2
        self._delays = mx.array(cfg.delays, mx.int32)
        self._initial = mx.array(cfg.start_tokens, mx.int32)
        self.compiled = mx.compile(self.step)

    def step(
        self,
        codes: mx.array,
        tokens: mx.array,
        key: mx.array,
        keys: list[mx.array],
        values: list[mx.array],
        position: mx.array,
    ) -> tuple:
        """codes (B, n_q), tokens (B, K, width) -> the text tokens out (B,), the text logits
        (B, text_card), the heads' probabilities (B, heads, classes), the next token ring,
        key, and KV ring arrays."""
        lm, cfg, t, width = self.lm, self.lm.cfg, position, self.width
        batch = codes.shape[0]
        columns = mx.broadcast_to(
            ((t + self._delays[1:]) % width)[None, :, None], (batch, cfg.n_q, 1)
        )
        written = mx.put_along_axis(tokens[:, 1:], columns, codes[:, :, None], axis=2)
        tokens = mx.concatenate([tokens[:, :1], written], axis=1)
        inputs = mx.where(t <= self._delays, self._initial, tokens[:, :, t % width])  # (B, K)
        ring = KVRing(keys, values, position, cfg.attention_window)
        temporal_out, text_logits = lm.step_text(inputs[:, :, None], ring)
        key, text_key = mx.random.split(key)
        text = sample(text_logits, self.sampling.temp, self.sampling.top_k, text_key)
        t = t + 1
        tokens = mx.concatenate(
            [_put_column(tokens[:, 0], t % width, text)[:, None], tokens[:, 1:]], axis=1
        )
        out = tokens[:, 0, (t - cfg.max_delay + self._delays[0] + width) % width]
        heads = (
            lm.head_probabilities(temporal_out)
            if cfg.extra_heads_num_heads
            else mx.zeros((batch, 0, 0), mx.float32)
        )
        ring = ring.advanced()
        return out, text_logits, heads, tokens, key, ring.keys, ring.values, ring.position


def _put_column(rows: mx.array, column: mx.array, values: mx.array) -> mx.array:
    """rows (B, W) with rows[:, column] = values (B,)."""
    index = mx.broadcast_to(column.reshape(1, 1), (rows.shape[0], 1))
    return mx.put_along_axis(rows, index, values[:, None].astype(rows.dtype), axis=1)


def _step_function(lm: Lm, sampling: TextSampling) -> _StepFunction:
    shared = vars(lm).setdefault("_listen_step_functions", {})
    if sampling not in shared:
        shared[sampling] = _StepFunction(lm, sampling)
    return shared[sampling]


class ListenStepper:
    """Steps `batch` streams of a model without a depformer together; `reset` starts over."""

    def __init__(self, lm: Lm, batch: int = 1, sampling: TextSampling | None = None, seed: int = 0):
        if lm.cfg.dep_q:
            raise MoshiError("ListenStepper runs models without a depformer (dep_q 0)")
        self.lm = lm
        self.batch = batch
        self.seed = seed
        self._function = _step_function(lm, sampling or TextSampling())
        self.reset()

    def reset(self) -> None:
        cfg = self.lm.cfg
        width = self._function.width
        self._tokens = mx.full((self.batch, cfg.num_codebooks, width), UNGENERATED, mx.int32)
        self._ring = self.lm.make_ring(self.batch)
        self._key = mx.random.key(self.seed)
        self.step_index = 0

    def reserve(self, positions: int) -> None:
        """Give the KV ring room for `positions` steps now (at most the context), so that no
        later step pays for growing it; every step then attends over the whole room."""
        self._ring = self._ring.grown(max(positions, 1) - 1)

    @property
    def ready(self) -> bool:
        """Whether the last step returned text (the delays are filled)."""
        return self.step_index > self.lm.cfg.max_delay

    def step(self, codes: np.ndarray | mx.array) -> ListenStep:
        """Advance all streams by one frame of audio codes (B, n_q), lazily."""
        codes = mx.array(codes).astype(mx.int32) if not isinstance(codes, mx.array) else codes
        expected = (self.batch, self.lm.cfg.n_q)
        if codes.shape != expected:
            raise MoshiError(f"expected audio codes of shape {expected}, got {codes.shape}")
        out, logits, heads, self._tokens, self._key, *ring_state = self._outputs(codes)
        # No reference to the old ring's buffers may outlive this line: MLX then writes the
        # new position into them in place instead of copying the whole ring each step.
        self._ring = self._ring.replaced(*ring_state)
        mx.async_eval(out, heads, self._tokens, *ring_state)
        self.step_index += 1
        return ListenStep(out, logits, heads)

    def _outputs(self, codes: mx.array) -> tuple:
        self._ring = self._ring.grown(self.step_index)
        ring = self._ring
        return self._function.compiled(
            codes.astype(mx.int32), self._tokens, self._key, ring.keys, ring.values, ring.position
        )
