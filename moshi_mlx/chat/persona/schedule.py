"""The prompt phase of NVIDIA's PersonaPlex generator, as data.

NVIDIA's `LMGen.step_system_prompts` makes one generator call per prompt frame: the voice
frames (Moshi's stream: the voice's Mimi codes), 0.5 s of silence frames, one frame per role
token (the text stream: the token), 0.5 s of silence again. In every frame the text stream is
padding unless it carries a role token, Moshi's audio is the voice or `SILENCE_TOKENS`, and
the user's audio is `SINE_TOKENS`. Each token is written at its stream's delay ahead, and
each call but the first runs the model on the previous column, where every token is given.

Since every input is known in advance, `plan_prompt` replays those writes on the host and
returns what the model sees at each run (for one batched prefill) and the token columns the
conversation starts from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moshi_mlx.models.lm import LmConfig

# Mimi codes NVIDIA's generator uses for Moshi's silence and for the user's stream (a 440 Hz
# sine) during the prompt.
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
TEXT_PAD = 3  # the text stream's padding token during the prompt
SILENCE_FRAMES = int(0.5 * 12.5)  # NVIDIA's `audio_silence_frame_cnt` at Mimi's frame rate
_UNWRITTEN = -2


@dataclass(frozen=True)
class PromptPlan:
    """What the prompt feeds the model and leaves behind.

    inputs (runs, K): each model run's input column; columns (K, width) and given
    (1 + moshi_codebooks, width): the conversation's delayed tokens and their given marks, ring
    column c % width for absolute column c; runs: the steps the prompt takes (the
    conversation's first step index).
    """

    inputs: np.ndarray
    columns: np.ndarray
    given: np.ndarray
    runs: int


def prompt_frames(
    voice_codes: np.ndarray, role_tokens: list[int]
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The prompt's frames as (text token, Moshi's codes, user's codes): the voice's
    `voice_codes` (frames, 8), silence, the role's tokens, silence."""
    silence, sine = np.array(SILENCE_TOKENS), np.array(SINE_TOKENS)
    frames = [(TEXT_PAD, np.asarray(codes), sine) for codes in voice_codes]
    frames += [(TEXT_PAD, silence, sine)] * SILENCE_FRAMES
    frames += [(int(token), silence, sine) for token in role_tokens]
    frames += [(TEXT_PAD, silence, sine)] * SILENCE_FRAMES
    return frames


def plan_prompt(
    config: LmConfig,
    frames: list[tuple[int, np.ndarray, np.ndarray]],
    width: int,
    restored: tuple[int, np.ndarray] | None = None,
) -> PromptPlan:
    """Replay NVIDIA's column writes for `frames` (`prompt_frames`). `restored` (after frame
    index, its (K, slots) delayed tokens) overwrites the columns of a voice saved as
    embeddings, as NVIDIA's `load_voice_prompt_embeddings` replay does."""
    delays = np.array(config.delays)
    initial = np.array(config.start_tokens)
    calls = len(frames)
    tokens = np.full((config.num_codebooks, calls + width + config.max_delay), _UNWRITTEN)
    given = np.zeros(tokens.shape, bool)
    rows = np.arange(config.num_codebooks)
    inputs = []
    for call, (text, moshi, user) in enumerate(frames):
        columns = call + delays
        tokens[rows, columns] = np.concatenate([[text], moshi, user])
        given[rows, columns] = True
        early = call <= delays
        tokens[early, call], given[early, call] = initial[early], True
        if call == 0:
            tokens[:, 0] = initial
        else:
            inputs.append(tokens[:, call - 1].copy())
            if not given[:, call].all():
                raise AssertionError("a prompt frame left a token to sample")
            given[:, call - 1] = False
        if restored is not None and call == restored[0]:
            saved = restored[1]  # NVIDIA's ring: the `slots` columns up to call + 1
            slots = saved.shape[1]
            for column in range(max(call + 2 - slots, 0), call + 2):
                tokens[:, column] = saved[:, column % slots]
    runs = calls - 1
    ring = np.full((config.num_codebooks, width), _UNWRITTEN)
    ring_given = np.zeros((1 + config.moshi_codebooks, width), bool)
    for column in range(runs, runs + width):
        ring[:, column % width] = tokens[:, column]
        ring_given[:, column % width] = given[: 1 + config.moshi_codebooks, column]
    return PromptPlan(np.stack(inputs), ring, ring_given, runs)
