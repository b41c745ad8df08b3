"""Teacher forcing through the real step: a model's logits on given inputs.

No second forward path: the temporal transformer runs `Lm.step_text` over a `KVRing` one
position at a time, and the depformer its `Depformer.sample_step` with every token given
(forced to the inputs) and a sampler that records each slice's logits: the functions a
`ChatStepper`'s compiled step calls, run eagerly. To compare two models, two KV layouts,
or a model and Kyutai's reference, on exactly the same inputs (`moshi_mlx.chat.check`, the
parity tests).
"""

from __future__ import annotations

import mlx.core as mx

from moshi_mlx.chat.generate import condition_rows
from moshi_mlx.models.depformer import Depformer
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_quant import KVQuantization


def depformer_logits(depformer: Depformer, temporal_out: mx.array, previous: mx.array) -> mx.array:
    """The depformer's logits (B, slices, card) with each slice's input given: temporal_out
    (B, dim), previous (B, slices) the text token, then the codebooks before the last
    slice's."""
    batch, slices = previous.shape
    logits = []

    def record(slice_logits: mx.array, k: int) -> mx.array:
        logits.append(slice_logits)
        return mx.zeros((batch, 1), mx.int32)  # replaced by the given token

    forced = mx.concatenate([previous[:, 1:], mx.zeros((batch, 1), previous.dtype)], axis=1)
    given = (forced, mx.ones((batch, slices), mx.bool_))
    depformer.sample_step(temporal_out, previous[:, 0], record, given, codebooks=slices)
    return mx.stack(logits, axis=1)


def teacher_forced_logits(
    lm: Lm,
    input_tokens: mx.array,
    previous_tokens: mx.array,
    kv_quantization: KVQuantization | None = None,
) -> tuple[mx.array, mx.array]:
    """Logits of `lm` on given inputs, step by step: input_tokens (T, K) of each step
    (`StepOutput.inputs`), previous_tokens (T, dep_q) the depformer's inputs (the text
    token, then codebooks 0..dep_q-2: `StepOutput.sampled[:dep_q]`) -> text logits
    (T, text_card) and audio logits (T, dep_q, card), float32. A conditioned model runs
    under its default condition, unguided (`ChatStepper` with cfg_coef 1)."""
    condition = condition_rows(lm, 1.0, None)
    ring = lm.make_ring(quantization=kv_quantization)
    text_logits, audio_logits = [], []
    for t in range(input_tokens.shape[0]):
        ring = ring.grown(t)
        temporal_out, text = lm.step_text(input_tokens[t][None, :, None], ring, condition)
        ring = ring.advanced()
        audio = depformer_logits(lm.depformer, temporal_out, previous_tokens[t][None])
        text_logits.append(text[0].astype(mx.float32))
        audio_logits.append(audio[0].astype(mx.float32))
        mx.eval(text_logits[-1], audio_logits[-1], ring.keys, ring.values, ring.position)
    return mx.stack(text_logits), mx.stack(audio_logits)
