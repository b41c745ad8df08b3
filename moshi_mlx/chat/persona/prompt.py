"""A PersonaPlex prompt as a generator state: one batched prefill instead of a step per frame.

NVIDIA's generator replays the prompt frame by frame at every connection. Every input of the
prompt is known in advance (`schedule.plan_prompt`), so the temporal transformer takes all
of them in one causal prefill (`Lm.prefill`), which leaves the KV ring as the step-by-step
replay would; the depformer is not run at all (every token of a prompt frame is given, so
nothing it samples is kept). The state is then shared by every conversation of that prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.generate import GenState
from moshi_mlx.chat.persona.schedule import SILENCE_FRAMES, plan_prompt, prompt_frames
from moshi_mlx.errors import ConfigError
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.delayed_tokens import delayed_tokens_width


@dataclass(frozen=True)
class VoicePrompt:
    """A voice: its Mimi codes (frames, 8), or NVIDIA's saved form of one (`.pt`): the input
    embeddings of its runs (frames - 1, dim) and the delayed tokens after it (K, slots)."""

    codes: np.ndarray | None = None
    embeddings: np.ndarray | None = None
    ring: np.ndarray | None = None

    @property
    def frames(self) -> int:
        return len(self.codes) if self.codes is not None else len(self.embeddings) + 1


def max_role_tokens(lm: Lm, voice: VoicePrompt) -> int:
    """How many role tokens fit in the context with this voice (the prompt must fit)."""
    return lm.config.attention_window - voice.frames - 2 * SILENCE_FRAMES


def prompt_state(
    lm: Lm,
    voice: VoicePrompt,
    role_tokens: list[int],
    kv_quantization: KVQuantization | None = None,
) -> GenState:
    """The state a conversation starts from after `voice` and the role's tokens (wrapped in
    `<system>` tags already), lazily: evaluate it (`mx.eval(state.ring.keys, ...)`) once."""
    config = lm.config
    room = max_role_tokens(lm, voice)
    if len(role_tokens) > room:
        raise ConfigError(
            f"the role is {len(role_tokens)} tokens long; with this voice ({voice.frames} "
            f"frames) it may be at most {room} tokens (the model's context is {config.attention_window})"
        )
    if voice.codes is not None:
        voice_codes, restored = voice.codes, None
    else:  # NVIDIA's replay feeds placeholder frames, then restores the saved delayed tokens
        voice_codes = np.full((voice.frames, config.moshi_codebooks), config.card)
        restored = (voice.frames - 1, voice.ring)
    frames = prompt_frames(voice_codes, role_tokens)
    if voice.codes is None:  # the placeholder frames' user stream, like their Moshi stream
        user = np.full(config.num_user_codebooks, config.card)
        frames[: voice.frames] = [(text, moshi, user) for text, moshi, _ in frames[: voice.frames]]
    width = delayed_tokens_width(config)
    plan = plan_prompt(config, frames, width, restored)
    embeddings = lm.embed(mx.array(plan.inputs.T[None], mx.int32))  # (1, runs, dim)
    if voice.embeddings is not None:
        saved = mx.array(voice.embeddings).astype(embeddings.dtype)[None]
        embeddings = mx.concatenate([saved, embeddings[:, saved.shape[1] :]], axis=1)
    ring = lm.prefill(embeddings, lm.make_ring(quantization=kv_quantization))
    return GenState(
        tokens=mx.array(plan.columns, mx.int32),
        given=mx.array(plan.given),
        ring=ring,
        step_index=plan.runs,
    )
