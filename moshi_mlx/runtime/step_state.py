"""What goes in and out of every step (chat, STT, TTS): named trees of arrays.

A step is a pure function `(StepState, inputs...) -> StepOutput`, compiled by the stepper
(`moshi_mlx.runtime.stepper`); MLX takes and returns NamedTuples whole, so no caller slices a
tuple by position. The state carries everything a step reads from the one before: the token
ring, the random key and the temporal transformer's `KVRing` (its buffers, its position,
which is also the step's index, and the rows' start positions of a batch whose streams come
and go).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from moshi_mlx.modules.kv_cache import Buffer, KVRing
from moshi_mlx.modules.kv_quant import KVQuantization


class StepState(NamedTuple):
    """A stepper's state between two frames, as arrays.

    tokens (..., K, width) int32: the delayed tokens (`moshi_mlx.runtime.delayed_tokens`);
    key: the random key of the next step's sampling;
    keys, values: the temporal `KVRing`'s buffers, one per layer;
    position () int32: the next step's index, the ring's next position;
    given (1 + moshi_codebooks, width) bool: the chat's text and Moshi tokens ahead that a
    prompt gives (not sampled); None for steppers without prompts;
    starts (B,) int32: the position each row's stream started at (`KVRing.starts`); None:
    all at 0.
    """

    tokens: mx.array
    key: mx.array
    keys: list[Buffer]
    values: list[Buffer]
    position: mx.array
    given: mx.array | None = None
    starts: mx.array | None = None

    @classmethod
    def of(
        cls, tokens: mx.array, key: mx.array, ring: KVRing, given: mx.array | None = None
    ) -> StepState:
        """The state of a delayed-token buffer, a random key and a `KVRing`."""
        return cls(tokens, key, ring.keys, ring.values, ring.position, given, ring.starts)

    def ring(self, context: int, quantization: KVQuantization | None = None) -> KVRing:
        """The state's `KVRing` (its context and quantization are the stepper's)."""
        return KVRing(self.keys, self.values, self.position, context, quantization, self.starts)

    def with_ring(self, ring: KVRing) -> StepState:
        """This state over another `KVRing` (grown to a larger capacity, a row started)."""
        return self._replace(
            keys=ring.keys, values=ring.values, position=ring.position, starts=ring.starts
        )


class StepOutput(NamedTuple):
    """What a step returns, lazily: the next state and the step's tokens.

    state: the next state; None in what a stepper hands its caller (`Stepper.step`), so that
    no caller holds the KV buffers the next step writes in place;
    text: the text token(s) this step gives out: the chat's () sampled (or given) token, STT's
    (B,) transcript token of the frame `max_delay` back, TTS's (B,) predicted token (before
    the text schedule);
    frame: the tokens of the frame `max_delay` steps back, delays undone (valid once they are
    filled): the chat's (moshi_codebooks,) Moshi codes, TTS's (B, 1 + dep_q) text then
    codebooks; None for STT;
    inputs (..., K): what the step fed the temporal transformer;
    sampled: the chat's (1 + moshi_codebooks,) text and Moshi tokens of this step, before the
    delays realign them; None elsewhere;
    text_logits: the logits the text token was sampled from, where a stepper gives them (STT
    (B, text_card); a conditioned chat model's guided (text_card,));
    audio_logits: a conditioned chat model's guided (moshi_codebooks, card);
    head_probabilities: STT's extra heads (B, heads, classes).
    """

    state: StepState | None
    text: mx.array
    frame: mx.array | None
    inputs: mx.array
    sampled: mx.array | None = None
    text_logits: mx.array | None = None
    audio_logits: mx.array | None = None
    head_probabilities: mx.array | None = None
