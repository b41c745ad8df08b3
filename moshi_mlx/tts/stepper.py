"""The TTS's step on the device: a batch of streams, one 80 ms frame each per call.

Step semantics follow Kyutai's PyTorch `LMGen` as `moshi.models.tts.TTSModel.generate` drives
it. Every stream is generated (no input audio): the delayed tokens feed stream k its start token
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
pure function (`TtsStepFunction.step`: `StepState` and the step's inputs in, `StepOutput`
out), compiled and run by `TtsStepper` on `moshi_mlx.runtime.stepper`, and one wait per
frame.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import removed_names
from moshi_mlx.models.depformer import ZERO_TOKEN
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.step_tricks import split_last
from moshi_mlx.modules.transformer import CrossKV
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import Sampling, guided_logits, gumbel_noise, split_key
from moshi_mlx.runtime.step_state import StepOutput, StepState
from moshi_mlx.runtime.stepper import StepFunction, Stepper

NEW_WORD, PAD = 0, 3  # the text tokens the TTS predicts: a word starts next, or nothing
STEP_FUNCTIONS_KEPT = 1  # one sampling at a time: traces are cheap to redo
NO_PREFIX = -(2**30)  # `masked_until` of a stream without a prefix: its null row's audio is fed
# Kyutai's TTS (its config's lm_gen_config): one temperature, 0.6, for text and audio;
# `LMGen`'s top-k 25 and 250.
TEXT_SAMPLING = Sampling(temp=0.6, top_k=25)
AUDIO_SAMPLING = Sampling(temp=0.6, top_k=250)


class TtsStepFunction(StepFunction):
    """The TTS's step for one model, sampling of the text and the audio, padding bonus (added
    to the padding logit: > 0 speaks slower), audio lag, number of codebooks `n_q` (None:
    all) and classifier-free guidance `cfg_coef` (1: none). Its variant `depformer` runs the
    depformer or not (the first `delay_steps`).

    With guidance (tts-0.75b-en-public, as Kyutai's `LMGen` with `cfg_is_masked_until` and
    `cfg_is_no_text`): each of the B streams has a null row, B more rows of the temporal
    transformer, fed the stream's inputs with its text "no input" and its audio "no input"
    until the row's `masked_until` (its prefix's frames plus `delay_steps`) plus the
    codebook's delay; the text is sampled from the streams' own logits, each codebook from
    `null + (logits - null) * cfg_coef`, and both rows feed the sample to the next slice."""

    def __init__(
        self,
        lm: Lm,
        text_sampling: Sampling,
        audio_sampling: Sampling,
        padding_bonus: float,
        delay_steps: int,
        n_q: int | None = None,
        cfg_coef: float = 1.0,
    ):
        super().__init__(lm)
        self.text_sampling = text_sampling
        self.audio_sampling = audio_sampling
        self.padding_bonus = padding_bonus
        self.n_q = lm.config.dep_q if n_q is None else n_q
        self.cfg_coef = cfg_coef  # != 1: guided by a null row per stream (`_with_null_rows`)
        # Codebook k is -1 before this step.
        self.audio_start = self.delayed_tokens.delays[1:] + delay_steps

    def step(
        self,
        state: StepState,
        condition: mx.array,
        cross: list[CrossKV],
        if_word: mx.array,
        otherwise: mx.array,
        masked_until: mx.array | None = None,
        depformer: bool = True,
    ) -> StepOutput:
        """The state (delayed tokens (B, K, width), random key, KV ring, the rows' starts), the
        conditions, the text tokens to feed per outcome (B,) and with guidance the null rows'
        `masked_until` (B,) -> the next state, the predicted text tokens (B,), the frame out
        (B, K) and the step's inputs (B, K)."""
        config, delayed, t = self.lm.config, self.delayed_tokens, state.position
        batch = state.tokens.shape[0]
        kv = self.kv_ring(state)
        guided = self.cfg_coef != 1.0
        if state.starts is None:
            steps = t
            inputs = delayed.inputs(state.tokens, t)  # (B, K)
        else:  # the ring's first B rows are the streams' (then, with guidance, their null rows)
            starts = state.starts[:batch] if guided else state.starts
            steps = (t - starts)[:, None]  # (B, 1): each row's own step
            current = delayed.column(state.tokens, t)
            inputs = mx.where(steps <= delayed.delays, delayed.start_tokens, current)
        rows = self._with_null_rows(inputs, steps, masked_until) if guided else inputs
        temporal_out, text_logits = self.lm.step_text(rows, kv, condition, cross)
        if guided:  # the text is not guided: the streams' own logits
            text_logits = text_logits[:batch]
        key, text_key, audio_key = split_key(state.key, 3)
        text_logits = text_logits.astype(mx.float32)
        if self.padding_bonus:
            bonus = mx.zeros(text_logits.shape[-1]).at[PAD].add(self.padding_bonus)
            text_logits = text_logits + bonus
        predicted = self.text_sampling.sample(text_logits, text_key)
        text = mx.where(predicted == NEW_WORD, if_word, otherwise)
        if depformer:
            audio_sampling = self.audio_sampling
            # Every codebook's noise in one draw, split in a few splits: (B, card) each.
            noises = [None] * config.dep_q
            if audio_sampling.draws:
                noise = gumbel_noise((batch, config.dep_q * config.card), audio_key)
                noises = split_last(noise, [config.card * k for k in range(1, config.dep_q)])

            def sample_audio(logits: mx.array, k: int) -> mx.array:
                return audio_sampling.sample_column(logits, noises[k])

            def sample_guided(logits: mx.array, k: int) -> mx.array:
                token = sample_audio(guided_logits(logits, self.cfg_coef), k)
                return mx.concatenate([token, token])  # the next slice's input, both rows

            if guided:
                audio = self.lm.depformer.sample_step(
                    temporal_out, mx.concatenate([text, text]), sample_guided, codebooks=self.n_q
                )[:batch]
            else:
                audio = self.lm.depformer.sample_step(
                    temporal_out, text, sample_audio, codebooks=self.n_q
                )
            if self.n_q < config.dep_q:  # the codebooks not generated are fed as "no token"
                skipped = mx.full((batch, config.dep_q - self.n_q), ZERO_TOKEN, mx.int32)
                audio = mx.concatenate([audio, skipped], axis=1)
        else:
            audio = mx.full((batch, config.dep_q), ZERO_TOKEN, mx.int32)
        audio = mx.where(steps < self.audio_start, ZERO_TOKEN, audio)
        column = mx.concatenate([text[:, None], audio], axis=1)  # (B, K)
        tokens = delayed.write_column(state.tokens, kv.next_position, column)
        frame = delayed.frame_out(tokens, t)
        return StepOutput(StepState.of(tokens, key, kv.advanced()), predicted, frame, inputs)

    def _with_null_rows(
        self, inputs: mx.array, steps: mx.array, masked_until: mx.array
    ) -> mx.array:
        """The streams' inputs (B, K), then their null rows': "no input" where the stream's
        start tokens are over and, for the text, always; for codebook k, until step
        `masked_until + delays[k]` (Kyutai's `cfg_is_masked_until`, `cfg_is_no_text`)."""
        delays = self.delayed_tokens.delays
        started = steps > delays
        masked = (steps <= delays + masked_until[:, None]) | (mx.arange(delays.shape[0]) == 0)
        null = mx.where(masked & started, ZERO_TOKEN, inputs)
        return mx.concatenate([inputs, null])


class TtsStepper(Stepper):
    """Steps a batch of B TTS streams.

    Args:
        lm: the model.
        condition: (B, dim) the summed conditions (`Lm.condition`).
        cross: the voices' cross-attention keys and values (`Lm.cross_keys_values`).
        delay_steps: the audio's lag behind the text, in steps.
        text_sampling, audio_sampling: how the text and the codebooks are drawn (default:
            Kyutai's, `TEXT_SAMPLING` and `AUDIO_SAMPLING`).
        seed: the random stream's seed.
        compiled_steps: the model's `ModelMemo` of compiled steps, shared with the other
            steppers given it (None: this stepper compiles its own).
        n_q: the codebooks generated (the first n_q; the others stay -1; None: all).
        padding_bonus: added to the padding logit (> 0: slower speech).
        masked_until: with guidance (`cfg_coef` != 1), per stream the step its null row's
            audio stops being masked before the codebooks' delays (`TtsStepFunction`).
        cfg_coef: classifier-free guidance by a null row per stream (1: none; for a model
            without a distilled "cfg" condition, `LmConfig.direct_guidance`).

    `condition`, `cross` (None: a model without them) and `masked_until` may be replaced
    between steps (a batch whose rows change). The streams are `condition`'s rows, else
    `masked_until`'s, else 1.
    """

    def __init__(
        self,
        lm: Lm,
        condition: mx.array | None,
        cross: list[CrossKV] | None,
        delay_steps: int,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int = 0,
        compiled_steps: ModelMemo[TtsStepFunction] | None = None,
        n_q: int | None = None,
        padding_bonus: float = 0.0,
        masked_until: list[int] | None = None,
        cfg_coef: float = 1.0,
    ):
        self.condition = condition
        self.cross = cross
        self.delay_steps = delay_steps
        text_sampling, audio_sampling = (
            text_sampling or TEXT_SAMPLING,
            audio_sampling or AUDIO_SAMPLING,
        )
        choice = (text_sampling, audio_sampling, padding_bonus, delay_steps, n_q, cfg_coef)
        function = TtsStepFunction.shared(lm, compiled_steps, choice, STEP_FUNCTIONS_KEPT)
        streams = (
            condition.shape[0]
            if condition is not None
            else (1 if masked_until is None else len(masked_until))
        )
        self.masked_until = None
        if cfg_coef != 1.0:
            until = [NO_PREFIX] * streams if masked_until is None else masked_until
            self.masked_until = mx.array(until, mx.int32)
        self.streams = streams
        tokens = function.delayed_tokens.empty(streams)
        rows = streams * (1 if cfg_coef == 1.0 else 2)
        super().__init__(function, StepState.of(tokens, mx.random.key(seed), lm.make_ring(rows)))

    def start_row(self, row: int) -> None:
        """Start a new stream in row `row` at the next step (`Stepper.start_row`), with
        guidance its null row too."""
        super().start_row(row)
        if self.masked_until is not None:
            ring = self.ring.with_row_started(self.streams + row)
            self._state = self._state.with_ring(ring)
            mx.eval(self._state.starts)

    def step(
        self,
        if_word: list[int],
        otherwise: list[int],
        forced: tuple[np.ndarray, np.ndarray] | None = None,
        depformer: bool | None = None,
    ) -> StepOutput:
        """Queue one step; each stream feeds `if_word[b]` as its text token if the model
        predicts a new word, else `otherwise[b]`. `forced`, codes and a mask (B, dep_q),
        replaces the audio tokens the step sampled where the mask is set (an audio prefix's,
        `TtsRun`), as they are written and in the frame out. `depformer`: whether the
        depformer runs (None: once `delay_steps` have passed). Returns at once (lazy results,
        evaluation queued): `text` (B,) the predicted text tokens (before the schedule),
        `frame` (B, 1 + dep_q) the tokens of the frame `max_delay` steps back (text then
        codebooks, delays undone; valid once `ready`)."""
        if depformer is None:
            depformer = self.step_index >= self.delay_steps
        guidance = () if self.masked_until is None else (self.masked_until,)
        out = self._run(
            self.condition,
            self.cross,
            mx.array(if_word, mx.int32),
            mx.array(otherwise, mx.int32),
            *guidance,
            depformer=depformer,
        )
        if forced is None:
            return out
        frame, tokens = self._forced(self._state.tokens, *forced)
        self._state = self._state._replace(tokens=tokens)
        mx.async_eval(frame, tokens)
        return out._replace(frame=frame)

    def _forced(
        self, tokens: mx.array, codes: np.ndarray, mask: np.ndarray
    ) -> tuple[mx.array, mx.array]:
        """The frame out and the delayed tokens of the step just taken with its audio tokens
        replaced by `codes` where `mask` is set."""
        delayed, t = self.function.delayed_tokens, self.step_index - 1
        column = delayed.column(tokens, mx.array(t + 1))
        audio = mx.where(mx.array(mask), mx.array(codes, mx.int32), column[:, 1:])
        tokens = delayed.write_column(
            tokens, mx.array(t + 1), mx.concatenate([column[:, :1], audio], 1)
        )
        return delayed.frame_out(tokens, mx.array(t)), tokens


__getattr__ = removed_names(
    __name__,
    {
        "TtsSampling": "TtsSampling is now one Sampling per stream (moshi_mlx.runtime.sampling): "
        "text_sampling=Sampling(0.6, 25), audio_sampling=Sampling(0.6, 250), and "
        "padding_bonus its own argument",
        "TtsStepFunctions": "TtsStepFunctions is now TtsStepFunction (moshi_mlx.tts.stepper)",
        "TtsStepOutput": "TtsStepOutput is now StepOutput (moshi_mlx.runtime.step_state): "
        "predicted is its text",
    },
)
