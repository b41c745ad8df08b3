"""Streaming generation: one call per 80 ms frame, the user's codes in, Moshi's tokens out.

Step semantics follow Kyutai's PyTorch `LMGen`. Each stream k is fed with a delay of
`delays[k]` steps: while step t <= delays[k] the stream gets its start token (text_card for
text, card — audio padding — for audio). The user's codes given at step t are fed at step
t + delay. Moshi's streams are sampled already delayed: the tokens sampled at step t are fed
at step t + 1, and codebook k's token of step t belongs to the audio frame t - delays[k].
Once the delays are filled, each step returns Moshi's codes of one frame, realigned across
codebooks. (`StepOutput.inputs` shows what each step fed the model.)

PersonaPlex (`LmConfig.generator` "personaplex") follows NVIDIA's `LMGen`, which is the same
but for two things: a user frame is fed `user_input_lag` (1) step later, and a conversation
starts from a prompt's state (`GenState`, made by `moshi_mlx.chat.persona`) in which some of
Moshi's tokens ahead are already given: where a token is given, the step returns it (and
feeds it to the next depformer slice) instead of the sampled one. The depformer samples only
Moshi's codebooks: PersonaPlex's slices for the user's codebooks would be sampled and thrown
away (the user's stream is always given), and come after Moshi's, so they change nothing.

The step (`ChatStepFunction.step`, run by `ChatStepper` on `moshi_mlx.runtime.stepper`) is a
pure function, `StepState` and the user's codes in, `StepOutput` out: the delayed tokens with their
delays (`runtime.delayed_tokens`), the temporal transformer over its `KVRing`, the text and audio
sampling and the depformer's 8 slices. Nothing in a step waits for the device:
`ChatStepper.step` returns lazy arrays with their evaluation queued, and the caller reads them
with one evaluation per frame, with whatever it computes from them.

Hibiki (a model with `conditioners`) adds its condition vector to every step's input and
runs classifier-free guidance as Kyutai's PyTorch `LMGen` does: with `cfg_coef` != 1 the
temporal transformer and the depformer run a batch of 2, the guided condition ("very_good")
and the null one ("very_bad"), and the text and each codebook are sampled from
`null + (guided - null) * cfg_coef`; with 1.0, one conditioned row. Models without
conditioners keep their step graph as it was.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import MoshiError, removed_names
from moshi_mlx.models.conditioners import GUIDED_CONDITION, NULL_CONDITION
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.modules.step_tricks import split_last
from moshi_mlx.runtime.delayed_tokens import DelayedTokens
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import Sampling, guided_logits, gumbel_noise, split_key
from moshi_mlx.runtime.step_state import StepOutput, StepState
from moshi_mlx.runtime.stepper import StepFunction, Stepper

# Kyutai's Moshi defaults (its LMGen): audio sampled hotter than text.
TEXT_SAMPLING = Sampling(temp=0.7, top_k=25)
AUDIO_SAMPLING = Sampling(temp=0.8, top_k=250)
ChatSampling = tuple[Sampling, Sampling]  # a conversation's: the text's, then the audio's


@dataclass(frozen=True)
class GenState:
    """Where a conversation stands, as arrays: a fresh one (`ChatStepper.reset`), or a
    prompt's (`moshi_mlx.chat.persona`), which every conversation of that prompt starts from.

    tokens (K, width) int32: the delayed tokens, column t % width for step t's inputs;
    given (1 + moshi_codebooks, width) bool: the text and Moshi tokens ahead that are given,
    not sampled; ring: the temporal transformer's `KVRing`; step_index: the next step.
    MLX arrays are immutable: several conversations can start from one state.
    """

    tokens: mx.array
    given: mx.array
    ring: KVRing
    step_index: int


class ChatStepFunction(StepFunction):
    """The chat's step for one model, sampling of the text and the audio, KV layout and
    guidance (`cfg_coef`), shared by every `ChatStepper` given the same `ModelMemo`."""

    def __init__(
        self,
        lm: Lm,
        text_sampling: Sampling,
        audio_sampling: Sampling,
        kv_quantization: KVQuantization | None = None,
        cfg_coef: float = 1.0,
    ):
        super().__init__(lm, kv_quantization)
        self.text_sampling = text_sampling
        self.audio_sampling = audio_sampling
        self.cfg_coef = cfg_coef
        self.guided = cfg_coef != 1.0
        self.conditioned = bool(lm.config.conditioners)
        self.compiled_sample_tokens = mx.compile(self.sample_tokens)

    def sample_tokens(
        self,
        temporal_out: mx.array,
        text_logits: mx.array,
        key: mx.array,
        given_tokens: mx.array | None = None,
        given: mx.array | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Sample the text token, then Moshi's codebooks through the depformer.

        temporal_out (1, dim), text_logits (1, text_card) -> the (1 + moshi_codebooks,) tokens
        and the next random key, lazily. Where `given` (1 + moshi_codebooks,) bool is true,
        the token of `given_tokens` is taken instead of the sampled one. With guidance,
        temporal_out and text_logits hold the guided row then the null row.
        """
        return self._sample(temporal_out, text_logits, key, given_tokens, given)[:2]

    def _guide(self, logits: mx.array) -> mx.array:
        """Logits (2, N) of the guided and null rows -> the guided logits (1, N)."""
        return guided_logits(logits, self.cfg_coef)

    def _sample(
        self,
        temporal_out: mx.array,
        text_logits: mx.array,
        key: mx.array,
        given_tokens: mx.array | None = None,
        given: mx.array | None = None,
    ) -> tuple[mx.array, mx.array, mx.array, list[mx.array]]:
        """`sample_tokens`, also giving the (guided) text and each codebook's logits."""
        config, guided, audio_sampling = self.lm.config, self.guided, self.audio_sampling
        key, text_key, audio_key = split_key(key, 3)
        if guided:
            text_logits = self._guide(text_logits)
        text_noise = gumbel_noise(text_logits.shape, text_key) if self.text_sampling.draws else None
        text = self.text_sampling.sample_column(text_logits, text_noise)  # (B, 1)
        # Every codebook's noise in one draw, split once: (B, card) each.
        noises = [None] * config.moshi_codebooks
        if audio_sampling.draws:
            shape = (text_logits.shape[0], config.moshi_codebooks * config.card)
            noise = gumbel_noise(shape, audio_key)
            noises = split_last(noise, [config.card * k for k in range(1, config.moshi_codebooks)])
        forced = None
        if given is not None:
            text = mx.where(given[0], given_tokens[0], text.astype(mx.int32))
            forced = (given_tokens[None, 1:], given[None, 1:])
        audio_logits = []

        def sample_audio(logits: mx.array, k: int) -> mx.array:
            if guided:
                logits = self._guide(logits)
            audio_logits.append(logits)
            token = audio_sampling.sample_column(logits, noises[k])
            return mx.concatenate([token, token]) if guided else token  # both rows go on

        prev = mx.concatenate([text, text]) if guided else text
        tokens = self.lm.depformer.sample_step(
            temporal_out, prev, sample_audio, forced, text_sampled=True, with_text=True
        )  # (B, 1 + moshi_codebooks): the text, then the codebooks
        generated = tokens.reshape(-1) if tokens.shape[0] == 1 else tokens[0]
        return generated, key, text_logits, audio_logits

    def step(
        self, state: StepState, user_codes: mx.array, condition: mx.array | None = None
    ) -> StepOutput:
        """One step, arrays in, arrays out: the state (delayed tokens and their given marks, random
        key, temporal `KVRing`) and the user's codes (num_user_codebooks,) (and a conditioned
        model's condition (B, dim), B = 2 with guidance) -> the next state, the text token,
        Moshi's codes (valid once the delays are filled), the step's inputs and sampled
        tokens (and a conditioned model's text and audio logits)."""
        config, delayed, t = self.lm.config, self.delayed_tokens, state.position
        moshi_rows = slice(0, 1 + config.moshi_codebooks)  # the text, then Moshi's codebooks
        user_rows = slice(moshi_rows.stop, None)
        lag = config.user_input_lag
        tokens = delayed.write_delayed(state.tokens, t + lag, user_codes, user_rows)
        # Read as the write leaves it, without reading the written buffer (`column`).
        inputs = delayed.inputs(state.tokens, t, (user_codes, user_rows, lag))

        kv = self.kv_ring(state)
        after = kv.next_position  # t + 1, the one array the advanced ring holds
        batch_inputs = inputs  # one row, looked up without a batch axis (`Lm.embed`)
        if self.guided:  # the same tokens in both rows; only the condition differs
            batch_inputs = mx.concatenate([inputs[None], inputs[None]])
        temporal_out, text_logits = self.lm.step_text(batch_inputs, kv, condition)
        key, given = state.key, state.given
        guided_text = guided_audio = None  # a conditioned model's logits
        if self.conditioned:
            generated, key, text, audio = self._sample(temporal_out, text_logits, key)
            guided_text, guided_audio = text[0], mx.concatenate(audio)
        elif config.prompted:  # only a prompt gives tokens ahead: Moshi's step keeps its graph
            generated, key = self.sample_tokens(
                temporal_out,
                text_logits,
                key,
                delayed.column(state.tokens, after, moshi_rows),  # not the user's rows
                delayed.column(given, after),
            )
            # The input column's marks are spent; it is written again `width` steps later.
            given = mx.where(mx.arange(delayed.width) == t % delayed.width, False, given)
        else:
            generated, key = self.sample_tokens(temporal_out, text_logits, key)

        tokens = delayed.write_column(tokens, after, generated, moshi_rows)
        moshi_codes = delayed.frame_out(tokens, t, slice(1, moshi_rows.stop))
        next_state = StepState.of(tokens, key, kv.advanced(), given)
        return StepOutput(
            next_state, generated[0], moshi_codes, inputs, generated, guided_text, guided_audio
        )


def fresh_state(lm: Lm, kv_quantization: KVQuantization | None = None, batch: int = 1) -> GenState:
    """The state of a conversation that starts from nothing (Moshi's; `batch` 2: Hibiki's
    guided and null rows)."""
    delayed = DelayedTokens.of(lm.config)
    return GenState(
        tokens=delayed.empty(),
        given=mx.zeros((1 + lm.config.moshi_codebooks, delayed.width), mx.bool_),
        ring=lm.make_ring(batch, kv_quantization),
        step_index=0,
    )


class ChatStepper(Stepper):
    """Steps one conversation of a chat model (Moshi, PersonaPlex, Hibiki) over an `Lm`;
    `reset()` starts a new one (from `start`, a prompt's state, if given: its KV cache must
    be quantized as `kv_quantization` says).

    Args:
        lm: the model.
        text_sampling, audio_sampling: how the text and Moshi's codebooks are drawn
            (default: Kyutai's, `TEXT_SAMPLING` and `AUDIO_SAMPLING`).
        seed: the random stream's seed (None: drawn at random).
        kv_quantization: how the KV ring's keys and values are stored (None: as computed).
        start: a prompt's state to start from (PersonaPlex).
        cfg_coef: a conditioned model's (Hibiki's) classifier-free guidance against the null
            condition "very_bad" (default: the checkpoint's `lm_gen_config`, else 1.0: none),
            as Kyutai's PyTorch `LMGen`. (Kyutai's MLX `LmGen` gives both rows the same
            condition, so its guidance changes nothing.)
        condition: a conditioned model's condition (default: "very_good").
        compiled_steps: the model's `ModelMemo` of compiled steps, shared with the other
            steppers given it (None: this stepper compiles its own).
    """

    def __init__(
        self,
        lm: Lm,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int | None = None,
        kv_quantization: KVQuantization | None = None,
        start: GenState | None = None,
        cfg_coef: float | None = None,
        condition: Mapping[str, str] | None = None,
        compiled_steps: ModelMemo[ChatStepFunction] | None = None,
    ):
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        if start is not None and start.ring.quantization != kv_quantization:
            raise MoshiError("the prompt's KV cache is not quantized as this stepper's")
        self.start = start
        self.cfg_coef = default_cfg_coef(lm.config) if cfg_coef is None else float(cfg_coef)
        self._condition = condition_rows(lm, self.cfg_coef, condition)
        choice = (
            text_sampling or TEXT_SAMPLING,
            audio_sampling or AUDIO_SAMPLING,
            kv_quantization,
            self.cfg_coef,
        )
        function = ChatStepFunction.shared(lm, compiled_steps, choice)
        super().__init__(function, *self._fresh(function))

    def _fresh(self, function: ChatStepFunction) -> tuple[StepState, int]:
        """The state and step index a conversation starts from (the seed's random stream)."""
        batch = 1 if self._condition is None else self._condition.shape[0]
        start = self.start or fresh_state(function.lm, function.kv_quantization, batch)
        key = mx.random.key(self.seed)
        return StepState.of(start.tokens, key, start.ring, start.given), start.step_index

    def reset(self) -> None:
        """Forget the conversation; the random stream restarts from the stepper's seed."""
        self._state, self.step_index = self._fresh(self.function)

    def _user_array(self, user_codes: np.ndarray | mx.array) -> mx.array:
        if not isinstance(user_codes, mx.array):
            user_codes = mx.array(np.asarray(user_codes).astype(np.int32))
        # Reshaped only when not flat already: a reshape is one more operation a step to run.
        codes = user_codes if user_codes.ndim == 1 else user_codes.reshape(-1)
        expected = self.lm.config.num_user_codebooks
        if codes.shape != (expected,):
            raise MoshiError(
                f"ChatStepper.step expects {expected} user codes, got shape {user_codes.shape}"
            )
        return codes.astype(mx.int32)

    def _inputs(self, user_codes: np.ndarray | mx.array) -> tuple[mx.array, ...]:
        codes = self._user_array(user_codes)
        return (codes,) if self._condition is None else (codes, self._condition)

    def sample_tokens(
        self, temporal_out: mx.array, text_logits: mx.array, key: mx.array
    ) -> tuple[mx.array, mx.array]:
        """The step's sampling part alone, compiled (`ChatStepFunction.sample_tokens`)."""
        return self.function.compiled_sample_tokens(temporal_out, text_logits, key)

    def step(self, user_codes: np.ndarray | mx.array) -> StepOutput:
        """Advance one frame with the user's codes (num_user_codebooks,) (token -1: no input).

        Returns at once: the step computes on the device while the caller goes on building
        (its evaluation is queued), and its tokens are read with one evaluation: `text` ()
        the text token (ids 0 and 3: padding), `frame` (moshi_codebooks,) Moshi's codes
        (None until the delays are filled: `ready`), `inputs` (K,) what the step fed the
        temporal transformer, `sampled` (1 + moshi_codebooks,) the text token and Moshi's
        codebooks of this step before the delays realign them; a conditioned model's
        `text_logits` (text_card,) and `audio_logits` (moshi_codebooks, card), guided when
        `cfg_coef` != 1.
        """
        out = self._run(*self._inputs(user_codes))
        return out if self.ready else out._replace(frame=None)

    def step_graph(self, user_codes: np.ndarray | mx.array, compiled: bool = True) -> StepOutput:
        """`Stepper.graph` of the next step with these user codes."""
        return self.graph(*self._inputs(user_codes), compiled=compiled)


def default_cfg_coef(config: LmConfig) -> float:
    """The guidance a checkpoint runs with: its `lm_gen_config.cfg_coef`, else 1.0 (none)."""
    coef = config.lm_gen_config.cfg_coef
    return 1.0 if coef is None else coef


def condition_rows(lm: Lm, cfg_coef: float, condition: Mapping[str, str] | None) -> mx.array | None:
    """A conditioned model's condition vectors (B, dim): the guided row, then with guidance
    the null row; None for a model without conditioners."""
    if not lm.config.conditioners:
        if cfg_coef != 1.0 or condition is not None:
            raise MoshiError("this model takes no condition, so no guidance (cfg_coef 1)")
        return None
    rows = [dict(condition or GUIDED_CONDITION)]
    if cfg_coef != 1.0:
        rows.append(dict(NULL_CONDITION))
    return lm.condition(rows)


__getattr__ = removed_names(
    __name__,
    {
        "LmGen": "LmGen is now ChatStepper (moshi_mlx.chat.generate)",
        "LmGenStep": "LmGenStep is now StepOutput (moshi_mlx.runtime.step_state), what "
        "ChatStepper.step returns",
        "StepFunctions": "StepFunctions is now ChatStepFunction (moshi_mlx.chat.generate)",
        "step_functions": "step_functions(lm, ...) is now ChatStepFunction.shared(lm, memo, "
        "choice) (moshi_mlx.chat.generate)",
        "teacher_forced_logits": "teacher_forced_logits is now in moshi_mlx.chat.teacher_forcing",
    },
)
