"""The TTS's step on the device: a batch of streams, one 80 ms frame each per call.

Step semantics follow Kyutai's PyTorch `LMGen` as `moshi.models.tts.TTSModel.generate` drives
it. Every stream is generated (no input audio): the token ring feeds stream k its start token
while step t <= delays[k], then what was written for step t. The temporal transformer reads
the step's tokens, plus the summed conditions ("control", "cfg") and, by cross-attention, the
voices. The text token is sampled, then replaced by what the text schedule says to feed
(`moshi_mlx.tts.machine`); the depformer then samples the 32 codebooks from it. For the first
`delay_steps` steps the depformer does not run and the audio is the "no input" token -1; each
codebook also stays -1 until its delay plus `delay_steps` has passed.

The schedule's choice needs the sampled token, which lives on the device. Rather than wait
for it in the middle of the step, the host gives, per stream, the token to feed if the model
predicts a new word and the token otherwise (`TextSchedule.outcomes`); the step picks one and
returns the prediction, and the host commits it before the next step. A step is thus one
`mx.compile`d graph (`StepState` and the step's inputs in, `StepOutput` out; see
`moshi_mlx.runtime.step_state`) and one wait per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.models.depformer import ZERO_TOKEN
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.modules.transformer import CrossKV
from moshi_mlx.runtime.model_cache import ModelCache, model_cache
from moshi_mlx.runtime.sampling import gumbel_noise, sample, sample_column
from moshi_mlx.runtime.step_state import StepOutput, StepState
from moshi_mlx.runtime.token_ring import TokenRing

NEW_WORD, PAD = 0, 3  # the text tokens the TTS predicts: a word starts next, or nothing
STEP_FUNCTIONS_KEPT = 1  # one sampling at a time: traces are cheap to redo


@dataclass(frozen=True)
class TtsSampling:
    """Temperatures and top-k of the text and audio tokens (Kyutai's TTS: 0.6 for both,
    `LMGen`'s top-k 25 and 250), and the bonus added to the padding logit (> 0: slower)."""

    temp: float = 0.6
    text_top_k: int = 25
    audio_top_k: int = 250
    padding_bonus: float = 0.0


@dataclass
class TtsStepOutput:
    """One step's lazy results: `predicted` (B,) the text token the model predicted (before
    the schedule), `frame` (B, 1 + dep_q) the tokens of the frame `max_delay` steps back
    (text then codebooks, delays undone; valid once step > max_delay)."""

    predicted: mx.array
    frame: mx.array


class TtsStepFunctions:
    """The compiled steps of one model, sampling, audio lag and number of codebooks `n_q`
    (None: all): with and without the depformer, and `rows_full`, `rows_text_only` for rows
    started at different steps (`TtsBatch`: their start positions (B,) after the state)."""

    def __init__(self, lm: Lm, sampling: TtsSampling, delay_steps: int, n_q: int | None = None):
        self.lm = lm
        self.sampling = sampling
        self.n_q = lm.cfg.dep_q if n_q is None else n_q
        self.ring = TokenRing.of(lm.cfg)
        self.audio_start = self.ring.delays[1:] + delay_steps  # codebook k is -1 before this
        mx.eval(transpose_weights(lm))  # no weight transposes in the traced steps
        self.full = mx.compile(lambda *args: self.step(*args, depformer=True))
        self.text_only = mx.compile(lambda *args: self.step(*args, depformer=False))
        self.rows_full = mx.compile(
            lambda state, starts, *args: self.step(state, *args, depformer=True, starts=starts)
        )
        self.rows_text_only = mx.compile(
            lambda state, starts, *args: self.step(state, *args, depformer=False, starts=starts)
        )

    def step(
        self,
        state: StepState,
        condition: mx.array,
        cross: list[CrossKV],
        if_word: mx.array,
        otherwise: mx.array,
        depformer: bool,
        starts: mx.array | None = None,
    ) -> StepOutput:
        """The state (token ring (B, K, width), random key, KV ring), the conditions and the
        text tokens to feed per outcome (B,) -> the next state, the predicted text tokens
        (B,), the frame out (B, K) and the step's inputs (B, K). `starts` (B,): the position
        each row's stream started at (its step is the position minus its start)."""
        cfg, sampling, ring, t = self.lm.cfg, self.sampling, self.ring, state.position
        batch = state.tokens.shape[0]
        kv = state.ring(cfg.attention_window).with_starts(starts)
        if starts is None:
            steps = t
            inputs = ring.inputs(state.tokens, t)  # (B, K)
        else:
            steps = (t - starts)[:, None]  # (B, 1): each row's own step
            current = ring.column(state.tokens, t)
            inputs = mx.where(steps <= ring.delays, ring.start_tokens, current)
        temporal_out, text_logits = self.lm.step_text(inputs[..., None], kv, condition, cross)
        key, text_key, audio_key = mx.random.split(state.key, 3)
        text_logits = text_logits.astype(mx.float32)
        if sampling.padding_bonus:
            bonus = mx.zeros(text_logits.shape[-1]).at[PAD].add(sampling.padding_bonus)
            text_logits = text_logits + bonus
        predicted = sample(text_logits, sampling.temp, sampling.text_top_k, text_key)
        text = mx.where(predicted == NEW_WORD, if_word, otherwise)
        if depformer:
            # Every codebook's noise in one draw, split once: (B, card) each.
            noises = [None] * cfg.dep_q
            if sampling.temp > 0:
                noise = gumbel_noise((batch, cfg.dep_q * cfg.card), audio_key)
                noises = mx.split(noise, cfg.dep_q, axis=-1)

            def sample_audio(logits: mx.array, k: int) -> mx.array:
                return sample_column(logits, sampling.temp, sampling.audio_top_k, noises[k])

            audio = self.lm.depformer.sample_step(
                temporal_out, text, sample_audio, codebooks=self.n_q
            )
            if self.n_q < cfg.dep_q:  # the codebooks not generated are fed as "no token"
                skipped = mx.full((batch, cfg.dep_q - self.n_q), ZERO_TOKEN, mx.int32)
                audio = mx.concatenate([audio, skipped], axis=1)
        else:
            audio = mx.full((batch, cfg.dep_q), ZERO_TOKEN, mx.int32)
        audio = mx.where(steps < self.audio_start, ZERO_TOKEN, audio)
        column = mx.concatenate([text[:, None], audio], axis=1)  # (B, K)
        tokens = ring.write_column(state.tokens, t + 1, column)
        frame = ring.frame_out(tokens, t)
        return StepOutput(StepState.of(tokens, key, kv.advanced()), predicted, frame, inputs)


class TtsStepper:
    """Steps a batch of B TTS streams under fixed conditions: `condition` (B, dim), the summed
    conditions (`Lm.condition`), and `cross`, the voices' cross-attention keys and values
    (`Lm.cross_keys_values`). `delay_steps`: the audio's lag behind the text, in steps;
    `n_q`: the codebooks generated (the first n_q; the others stay -1; None: all).
    `step_cache`, the model's `ModelCache` of compiled steps, shares their traces with the
    other steppers given it (None: this stepper compiles its own)."""

    def __init__(
        self,
        lm: Lm,
        condition: mx.array,
        cross: list[CrossKV],
        delay_steps: int,
        sampling: TtsSampling | None = None,
        seed: int = 0,
        step_cache: ModelCache[TtsStepFunctions] | None = None,
        n_q: int | None = None,
    ):
        self.lm = lm
        self.batch = condition.shape[0]
        self.condition = condition
        self.cross = cross
        self.delay_steps = delay_steps
        self.sampling = sampling or TtsSampling()
        choice = (self.sampling, delay_steps, n_q)
        self._functions = model_cache(lm, step_cache, STEP_FUNCTIONS_KEPT).get(
            choice, lambda: TtsStepFunctions(lm, *choice)
        )
        tokens = self._functions.ring.empty(self.batch)
        self._state = StepState.of(tokens, mx.random.key(seed), lm.make_ring(self.batch))
        self.step_index = 0

    def step(
        self,
        if_word: list[int],
        otherwise: list[int],
        forced: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> TtsStepOutput:
        """Queue one step; each stream feeds `if_word[b]` as its text token if the model
        predicts a new word, else `otherwise[b]`. `forced`, codes and a mask (B, dep_q),
        replaces the audio tokens the step sampled where the mask is set (an audio prefix's,
        `TtsRun`), as they are written and in the frame out. Returns at once (lazy results,
        evaluation queued)."""
        ring = self._state.ring(self.lm.cfg.attention_window)
        self._state = self._state.with_ring(ring.grown(self.step_index))
        del ring  # the old buffers are written in place only if nothing else holds them
        function = (
            self._functions.full
            if self.step_index >= self.delay_steps
            else self._functions.text_only
        )
        out = function(
            self._state,
            self.condition,
            self.cross,
            mx.array(if_word, mx.int32),
            mx.array(otherwise, mx.int32),
        )
        frame = out.frame
        if forced is not None:
            frame, tokens = self._forced(out.state.tokens, *forced)
            out = out._replace(state=out.state._replace(tokens=tokens))
        self._state = out.state
        mx.async_eval(out.text, frame, out.state)
        self.step_index += 1
        return TtsStepOutput(out.text, frame)

    def _forced(
        self, tokens: mx.array, codes: np.ndarray, mask: np.ndarray
    ) -> tuple[mx.array, mx.array]:
        """The frame out and the token ring of this step with its audio tokens replaced by
        `codes` where `mask` is set."""
        ring, t = self._functions.ring, self.step_index
        column = ring.column(tokens, mx.array(t + 1))
        audio = mx.where(mx.array(mask), mx.array(codes, mx.int32), column[:, 1:])
        tokens = ring.write_column(
            tokens, mx.array(t + 1), mx.concatenate([column[:, :1], audio], 1)
        )
        return ring.frame_out(tokens, mx.array(t)), tokens

    @property
    def frame_ready(self) -> bool:
        """Whether the last step's frame holds tokens (its delays are filled)."""
        return self.step_index > self.lm.cfg.max_delay
