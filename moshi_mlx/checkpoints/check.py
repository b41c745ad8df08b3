"""`python -m moshi_mlx.quantize --check`: how closely a converted LM follows its source.

The source model generates greedily from random user codes; the converted model is then run
teacher-forced on exactly the inputs the source saw, and their tokens and logits compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.checkpoints.conversion import to_mlx_naming
from moshi_mlx.checkpoints.io import load_strict, read_safetensors
from moshi_mlx.checkpoints.lm import compute_dtype, load_lm, parameter_count
from moshi_mlx.models.lm import Lm, LmConfig


@dataclass
class CheckResult:
    """Greedy generation of the source model replayed through the converted model."""

    steps: int
    text_agreement: float  # fraction of steps where both models' greedy text tokens agree
    audio_agreement: float  # same, over every step and audio codebook
    max_text_logit_diff: float
    max_audio_logit_diff: float
    text_logit_rms: float  # RMS of the source's logits, to read the differences against
    audio_logit_rms: float
    relative_logit_error: float  # RMS of the differences / RMS of the source's logits

    def summary(self) -> str:
        return (
            f"check over {self.steps} greedy steps: tokens agree {100 * self.text_agreement:.1f}%"
            f" (text), {100 * self.audio_agreement:.1f}% (audio); max |logit difference| "
            f"{self.max_text_logit_diff:.4f} (text, logits RMS {self.text_logit_rms:.3f}), "
            f"{self.max_audio_logit_diff:.4f} (audio, logits RMS {self.audio_logit_rms:.3f}); "
            f"relative RMS logit error {self.relative_logit_error:.4f}"
        )


def _step_inputs(config: LmConfig, history: np.ndarray, t: int) -> mx.array:
    """Input tokens (1, K, 1) of step t, delayed per stream as in `LmGen`.

    history (K, steps): rows 0..dep_q hold the tokens generated at each step (text, Moshi's
    codebooks), the other rows the user's codes given at each step.
    """
    delays = np.array(config.delays)
    start = np.array([config.text_card] + [config.card] * config.n_q)
    generated = (np.arange(config.num_codebooks) <= config.dep_q).astype(np.int64)
    column = t - delays - generated  # generated tokens are fed one step later than user codes
    fed = history[np.arange(config.num_codebooks), np.maximum(column, 0)]
    tokens = np.where(t <= delays, start, fed)
    return mx.array(tokens.astype(np.int32))[None, :, None]


def _run_greedy(lm: Lm, user_codes: np.ndarray, reference: dict | None) -> dict:
    """Run `lm` step by step; without `reference`, feed back its own greedy tokens, else the
    reference's (teacher forcing), so both models see exactly the same inputs."""
    cfg = lm.cfg
    steps = user_codes.shape[1]
    history = np.zeros((cfg.num_codebooks, steps), np.int64)
    history[1 + cfg.dep_q :] = user_codes
    caches, depformer_caches = lm.make_caches(), lm.depformer.make_caches()
    text_logits, audio_logits = [], []
    for t in range(steps):
        temporal_out, text = lm.forward_text(_step_inputs(cfg, history, t), caches)
        text = text[:, -1].astype(mx.float32)  # (1, text_card)
        if reference is None:
            recorded: list[mx.array] = []

            def greedy(logits: mx.array, _: int, recorded=recorded) -> mx.array:
                recorded.append(logits.astype(mx.float32))
                return mx.argmax(logits, axis=-1).astype(mx.int32)

            first = mx.argmax(text, axis=-1).astype(mx.int32)
            lm.depformer.sample(temporal_out, first, depformer_caches, greedy)
            audio = mx.stack(recorded, axis=1)  # (1, dep_q, card)
            mx.eval(text, audio)
            history[0, t] = mx.argmax(text, axis=-1).item()
            history[1 : 1 + cfg.dep_q, t] = np.array(mx.argmax(audio, axis=-1)[0])
        else:
            history[: 1 + cfg.dep_q, t] = reference["tokens"][:, t]
            prev = mx.array(history[: cfg.dep_q, t].astype(np.int32))[None]
            audio = lm.depformer.logits(temporal_out, prev, depformer_caches)
            audio = audio.astype(mx.float32)
            mx.eval(text, audio)
        text_logits.append(np.array(text[0]))
        audio_logits.append(np.array(audio[0]))
    return {
        "tokens": history[: 1 + cfg.dep_q].copy(),
        "text_logits": np.stack(text_logits),  # (steps, text_card)
        "audio_logits": np.stack(audio_logits),  # (steps, dep_q, card)
    }


def load_source_lm(path: str | Path, config: LmConfig) -> Lm:
    """An unquantized `Lm` from a checkpoint in Kyutai's MLX or PyTorch naming, computing in
    the dtype `load_lm` would use for it."""
    tensors, _ = read_safetensors(path)
    model = Lm(config)
    dtype = compute_dtype(parameter_count(model), quantized=False)
    model.set_dtype(dtype)
    load_strict(model, to_mlx_naming(tensors, str(path)), str(path), dtype=dtype)
    mx.eval(model.parameters())
    return model


def compare_generation(
    source_path: str | Path,
    converted_path: str | Path,
    config: LmConfig,
    steps: int = 16,
    seed: int = 0,
) -> CheckResult:
    """Compare the converted model with the source on `steps` greedy steps of the same inputs.

    The source generates greedily from random user codes; the converted model is then run on
    exactly the inputs the source saw. The models are loaded one after the other, so memory
    holds one at a time. The converted model runs as `load_lm` builds it, so the figures
    include the quantized kernels' own rounding (on CPU, MLX's quantized matmul on bf16
    activations is far less precise than a dense one for wide layers).
    """
    rng = np.random.default_rng(seed)
    user_codes = rng.integers(0, config.card, (config.n_q - config.dep_q, steps))
    source = _run_greedy(load_source_lm(source_path, config), user_codes, None)
    mx.clear_cache()
    converted = _run_greedy(load_lm(converted_path, config), user_codes, source)
    text_diff = converted["text_logits"] - source["text_logits"]
    audio_diff = converted["audio_logits"] - source["audio_logits"]
    diffs = np.concatenate([text_diff.ravel(), audio_diff.ravel()])
    logits = np.concatenate([source["text_logits"].ravel(), source["audio_logits"].ravel()])
    return CheckResult(
        steps=steps,
        text_agreement=float(np.mean(converted["text_logits"].argmax(-1) == source["tokens"][0])),
        audio_agreement=float(
            np.mean(converted["audio_logits"].argmax(-1) == source["tokens"][1:].T)
        ),
        max_text_logit_diff=float(np.abs(text_diff).max()),
        max_audio_logit_diff=float(np.abs(audio_diff).max()),
        text_logit_rms=_rms(source["text_logits"]),
        audio_logit_rms=_rms(source["audio_logits"]),
        relative_logit_error=_rms(diffs) / max(_rms(logits), 1e-12),
    )


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values, dtype=np.float64))))
