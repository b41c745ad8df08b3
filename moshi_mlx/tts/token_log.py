"""A TTS run's tokens, step by step: what each step predicted, fed and gave out (`TtsTokens`),
and their log over a run (`TokenLog`)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class TtsTokens:
    """One step's tokens: per request the text token the model `predicted` and the one `fed`
    back (the schedule's), and the `frame` (B, 1 + dep_q) of the step `max_delay` back (text
    then codebooks, -1: no audio yet), None for the first `max_delay` steps."""

    predicted: list[int]
    fed: list[int]
    frame: mx.array | None


class TokenLog:
    """A run's tokens, step by step (`add`), the frames kept as the steps' arrays until
    `arrays` reads them all at once."""

    def __init__(self, codebooks: int):
        self.codebooks = codebooks
        self._predicted: list[list[int]] = []
        self._fed: list[list[int]] = []
        self._frames: list[mx.array] = []

    def add(self, tokens: TtsTokens) -> None:
        self._predicted.append(tokens.predicted)
        self._fed.append(tokens.fed)
        if tokens.frame is not None:
            self._frames.append(tokens.frame)

    def arrays(self, batch: int) -> dict[str, np.ndarray]:
        """Row b for request b: `predicted_text_tokens` (B, T) the text tokens the model
        predicted, `fed_text_tokens` (B, T) those fed back, `audio_codes` (B, n_q, F) the
        codes of the frames the steps returned (F = T - max_delay; -1: no audio yet)."""
        frames = np.array(mx.stack(self._frames), np.int32) if self._frames else None
        if frames is None:
            frames = np.zeros((0, batch, 1 + self.codebooks), np.int32)
        return {
            "predicted_text_tokens": np.array(self._predicted, np.int32).reshape(-1, batch).T,
            "fed_text_tokens": np.array(self._fed, np.int32).reshape(-1, batch).T,
            "audio_codes": frames[:, :, 1 : 1 + self.codebooks].transpose(1, 2, 0),
        }
