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
        self._depformer_caches = lm.depformer.make_caches()
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

    def _sample_audio(self, keys: mx.array):
        temp, top_k = self.sampling.audio_temp, self.sampling.audio_top_k
        return lambda logits, k: sample(logits, temp, top_k, keys[k])

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

        self._key, text_key, audio_key = mx.random.split(self._key, 3)
        audio_keys = mx.random.split(audio_key, cfg.dep_q)
        temporal_out, text_logits = self.lm.forward_text(tokens, self._caches)
        text = sample(
            text_logits[:, -1], self.sampling.text_temp, self.sampling.text_top_k, text_key
        )
        audio = self.lm.depformer.sample(
            temporal_out, text, self._depformer_caches, self._sample_audio(audio_keys)
        )
        generated = mx.concatenate([text, audio[0]])  # (1 + dep_q,)
        mx.eval(generated, self._key)
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
