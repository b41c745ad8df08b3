"""`python -m moshi_mlx quantize --check`: how closely a converted LM follows its source.

The source model generates greedily from random user codes through `ChatStepper`, which records
what each step fed the model and sampled; both models are then run teacher-forced on exactly
those inputs (`moshi_mlx.chat.teacher_forcing`), and their tokens and logits compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.teacher_forcing import teacher_forced_logits
from moshi_mlx.checkpoints.conversion import to_mlx_naming
from moshi_mlx.checkpoints.io import check_fits_model, read_safetensors
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.runtime.loading import LoadOptions, load_parts
from moshi_mlx.runtime.sampling import GREEDY


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


def _greedy_stream(lm: Lm, user_codes: np.ndarray) -> tuple[mx.array, mx.array]:
    """What `ChatStepper` fed `lm` and what it sampled, greedily, on the user's codes
    (n_user, steps): input tokens (steps, K) and sampled tokens (steps, 1 + moshi_codebooks).
    Unguided, as `teacher_forced_logits` runs a conditioned model."""
    generator = ChatStepper(lm, GREEDY, GREEDY, seed=0, cfg_coef=1.0)
    steps = [generator.step(mx.array(codes, mx.int32)) for codes in user_codes.T]
    inputs = mx.stack([step.inputs for step in steps])
    sampled = mx.stack([step.sampled for step in steps])
    mx.eval(inputs, sampled)
    return inputs, sampled


def _logits(lm: Lm, inputs: mx.array, sampled: mx.array) -> dict[str, np.ndarray]:
    text, audio = teacher_forced_logits(lm, inputs, sampled[:, : lm.config.moshi_codebooks])
    return {"text_logits": np.array(text), "audio_logits": np.array(audio)}


def check_source(path: str | Path, config: LmConfig) -> None:
    """Raise `WeightsMismatchError` unless the unquantized checkpoint at `path` (Kyutai's MLX
    or PyTorch naming) fits `config`; from its tensors' shapes, no weight is read."""
    tensors = read_safetensors(path).tensors
    schedule = config.depformer_weights_per_step_schedule
    converted = to_mlx_naming(tensors, str(path), config.dep_q, schedule=schedule)
    check_fits_model(Lm(config, full_depformer=True), converted, str(path))


def load_lm_file(path: str | Path, config: LmConfig) -> Lm:
    """The `Lm` of `config` from a checkpoint file (Kyutai's MLX or PyTorch naming, any
    precision), by the one load path."""
    path = Path(path)
    options = LoadOptions(moshi_weight=path, lm_config=config)
    return load_parts(str(path.parent), options, lm_only=True).lm


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
    holds one at a time. The converted model runs as `load_parts` builds it, so the figures
    include the quantized kernels' own rounding (on CPU, MLX's quantized matmul on bf16
    activations is far less precise than a dense one for wide layers).
    """
    rng = np.random.default_rng(seed)
    user_codes = rng.integers(0, config.card, (config.num_user_codebooks, steps))
    source_lm = load_lm_file(source_path, config)
    inputs, sampled = _greedy_stream(source_lm, user_codes)
    source = _logits(source_lm, inputs, sampled)
    del source_lm
    mx.clear_cache()
    converted = _logits(load_lm_file(converted_path, config), inputs, sampled)
    tokens = np.array(sampled)  # (steps, 1 + moshi_codebooks)
    text_diff = converted["text_logits"] - source["text_logits"]
    audio_diff = converted["audio_logits"] - source["audio_logits"]
    diffs = np.concatenate([text_diff.ravel(), audio_diff.ravel()])
    logits = np.concatenate([source["text_logits"].ravel(), source["audio_logits"].ravel()])
    return CheckResult(
        steps=steps,
        text_agreement=float(np.mean(converted["text_logits"].argmax(-1) == tokens[:, 0])),
        audio_agreement=float(np.mean(converted["audio_logits"].argmax(-1) == tokens[:, 1:])),
        max_text_logit_diff=float(np.abs(text_diff).max()),
        max_audio_logit_diff=float(np.abs(audio_diff).max()),
        text_logit_rms=_rms(source["text_logits"]),
        audio_logit_rms=_rms(source["audio_logits"]),
        relative_logit_error=_rms(diffs) / max(_rms(logits), 1e-12),
    )


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values, dtype=np.float64))))
