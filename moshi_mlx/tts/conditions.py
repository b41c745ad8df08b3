"""What a batch of TTS requests conditions the step on: the summed conditions ("control" and
the distilled guidance "cfg" of tts-1.6b-en_fr), the voices' cross-attention, or the
classifier-free guidance by null rows of a model that has neither (tts-0.75b-en-public,
`LmConfig.direct_guidance`, whose voice is an audio prefix)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from moshi_mlx.errors import TtsError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.transformer import CrossKV
from moshi_mlx.tts.stepper import NO_PREFIX


def condition_values(config: LmConfig, cfg_coef: float | None) -> dict[str, str | None]:
    """The summed conditions of a request: "control" ok, "cfg" the distilled guidance."""
    values: dict[str, str | None] = {name: None for name in config.fuser.sum}
    if "control" in values:
        values["control"] = "ok"
    if cfg_coef is not None:
        if "cfg" not in values:
            raise TtsError("this model was not trained with a guidance (cfg) condition")
        values["cfg"] = format(cfg_coef, ".1f")
    return values


@dataclass(frozen=True)
class StepConditions:
    """A run's conditions: `condition` (B, dim) summed into the input and `cross` the voices'
    keys and values (None: the model has none), `cfg_coef` the guidance by null rows (1:
    none) and `masked_until` (B,) each null row's masking (its prefix's frames plus the
    audio delay; None: a model with conditions)."""

    condition: mx.array | None
    cross: list[CrossKV] | None
    cfg_coef: float = 1.0
    masked_until: list[int] | None = None


def step_conditions(
    lm: Lm,
    voices: Sequence[Sequence[object]],
    cfg_coefs: Sequence[float | None],
    prefix_frames: Sequence[int],
    delay_steps: int,
    keys_values: Callable[[Sequence[Sequence[object]]], list[CrossKV]],
) -> StepConditions:
    """The conditions of B requests: their voices (read by `keys_values` if the model
    attends to voices), guidance values and prefixes' frames (0: none). A model without
    distilled guidance takes the requests' `cfg_coef` (one for all; None: 1) as guidance by
    null rows, masked until its prefix's frames plus `delay_steps`, as Kyutai's `TTSModel`
    (`cfg_is_no_prefix`, `cfg_is_no_text`)."""
    config = lm.config
    if not config.direct_guidance:
        cross = keys_values(voices) if config.cross_attention else None
        values = [condition_values(config, coef) for coef in cfg_coefs]
        return StepConditions(lm.condition(values) if config.fuser.sum else None, cross)
    coefs = {1.0 if coef is None else float(coef) for coef in cfg_coefs}
    if len(coefs) > 1:
        raise TtsError(f"the requests of one batch take one cfg_coef, got {sorted(coefs)}")
    [cfg_coef] = coefs
    if cfg_coef <= 0:
        raise TtsError(f"cfg_coef must be > 0 (1: no guidance), got {cfg_coef}")
    masked_until = [frames + delay_steps if frames else NO_PREFIX for frames in prefix_frames]
    return StepConditions(None, None, cfg_coef, masked_until)
