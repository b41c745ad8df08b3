"""Streaming generation: one call per 80 ms frame, the user's codes in, Moshi's tokens out.

Step semantics follow Kyutai's PyTorch `LMGen`. Each stream k is fed with a delay of
`delays[k]` steps: while step t <= delays[k] the stream gets its start token (text_card for
text, card — audio padding — for audio). The user's codes given at step t are fed at step
t + delay; Moshi's tokens sampled at step t are fed at step t + 1 + delay. Once the delays are
filled, each step returns Moshi's codes of one frame, realigned across codebooks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import MoshiError
from moshi_mlx.models.lm import Lm
from moshi_mlx.sampling import SamplingConfig, sample

UNGENERATED = -2  # a token slot not written yet


@dataclass(frozen=True)
class LmGenStep:
    """What one step produced.

    text_token: the text token sampled at this step (ids 0 and 3 are padding).
    moshi_codes: (dep_q,) int32 codes of Moshi's audio frame, or None until the delays are filled.
    """

    text_token: int
    moshi_codes: np.ndarray | None


class LmGen:
    """Stateful generator over an `Lm`; `reset()` starts a new conversation."""

    def __init__(self, lm: Lm, sampling: SamplingConfig | None = None, seed: int | None = None):
        self.lm = lm
        self.sampling = sampling or SamplingConfig()
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        cfg = lm.cfg
        self._delays = np.array(cfg.delays)
        self._initial = np.array([cfg.text_card] + [cfg.card] * cfg.n_q)
        self._num_user = cfg.n_q - cfg.dep_q
        self._caches = lm.make_caches()
        # Everything after the temporal transformer has the same shapes at every step, so it
        # is traced once and compiled: no per-step Python graph building for the 8 slices.
        self._compiled_sample = mx.compile(self._sample_tokens)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation; the random stream restarts from the generator's seed."""
        for cache in self._caches:
            cache.reset()
        self._key = mx.random.key(self.seed)
        # Ring of token slots: row k holds stream k, column (t % width) step t's input.
        self._tokens = np.full(
            (self.lm.cfg.num_codebooks, self.lm.cfg.max_delay + 2), UNGENERATED, np.int64
        )
        self.step_index = 0

    def _user_array(self, user_codes) -> np.ndarray:
        codes = np.asarray(user_codes).reshape(-1)
        if codes.shape != (self._num_user,):
            raise MoshiError(
                f"LmGen.step expects {self._num_user} user codes, got shape {codes.shape}"
            )
        return codes.astype(np.int64)

    def sample_tokens(
        self, temporal_out: mx.array, text_logits: mx.array, key: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Sample the text token, then Moshi's codebooks through the depformer (compiled).

        temporal_out (1, 1, dim), text_logits (1, 1, text_card) -> the (1 + dep_q,) tokens and
        the next random key, lazily.
        """
        return self._compiled_sample(temporal_out, text_logits, key)

    def _sample_tokens(
        self, temporal_out: mx.array, text_logits: mx.array, key: mx.array
    ) -> tuple[mx.array, mx.array]:
        # The depformer's caches live within one step, so they are made here, inside the
        # compiled function.
        sampling = self.sampling
        key, text_key, audio_key = mx.random.split(key, 3)
        audio_keys = mx.random.split(audio_key, self.lm.cfg.dep_q)
        text = sample(text_logits[:, -1], sampling.text_temp, sampling.text_top_k, text_key)
        audio = self.lm.depformer.sample(
            temporal_out,
            text,
            self.lm.depformer.make_caches(),
            lambda logits, k: sample(
                logits, sampling.audio_temp, sampling.audio_top_k, audio_keys[k]
            ),
        )
        return mx.concatenate([text, audio[0]]), key

    def step(self, user_codes: np.ndarray | mx.array) -> LmGenStep:
        """Advance one frame with the user's codes (n_q - dep_q,) (token -1: no input)."""
        cfg = self.lm.cfg
        t = self.step_index
        width = self._tokens.shape[1]
        user_rows = np.arange(1 + cfg.dep_q, cfg.num_codebooks)
        codes = self._user_array(user_codes)
        self._tokens[user_rows, (t + self._delays[user_rows]) % width] = codes
        inputs = np.where(t <= self._delays, self._initial, self._tokens[:, t % width])
        tokens = mx.array(inputs.astype(np.int32))[None, :, None]  # (1, K, 1)

        temporal_out, text_logits = self.lm.forward_text(tokens, self._caches)
        generated, self._key = self.sample_tokens(temporal_out, text_logits, self._key)
        mx.eval(generated, self._key)  # the step's one evaluation
        generated = np.array(generated, dtype=np.int64)

        t += 1
        self.step_index = t
        self._tokens[: 1 + cfg.dep_q, t % width] = generated
        moshi_codes = None
        if t > cfg.max_delay:
            rows = np.arange(1, 1 + cfg.dep_q)
            columns = (t - cfg.max_delay + self._delays[rows]) % width
            moshi_codes = self._tokens[rows, columns].astype(np.int32)
        return LmGenStep(text_token=int(generated[0]), moshi_codes=moshi_codes)
