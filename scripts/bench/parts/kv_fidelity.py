"""The `kv-fidelity` part: each quantized KV cache (`--kv-bits`) against the unquantized one,
teacher-forced on random tokens: relative logit error and greedy agreement."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.teacher_forcing import teacher_forced_logits
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.modules.kv_quant import KVQuantization, recent_slots
from moshi_mlx.testing.checkpoints import load_lm, logit_fidelity, random_teacher_tokens

from ..part import Part
from ..shapes import LM_SHAPES, dtype_label
from ..timing import fresh_memory
from .kv import kv_cases, kv_label


def bench_kv_fidelity(
    weights: Path, shape: str, kv_bits: list[int], steps: int, seed: int, dtype: mx.Dtype | None
) -> list[dict]:
    """Each quantized cache against the unquantized one on the first `steps` steps of a
    conversation, teacher-forced on random tokens (`teacher_forced_logits`): relative error
    of the text and depformer logits and greedy agreement, over all steps and over the steps
    past the unquantized ring of the newest positions (whose attention reads packed slots)."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    fresh_memory()
    lm = load_lm(weights, config, dtype=dtype)
    inputs, previous = random_teacher_tokens(config, steps, seed)
    reference = [np.array(a) for a in teacher_forced_logits(lm, inputs, previous)]

    def figures(ours: list[np.ndarray], first: int) -> dict | None:
        if first >= steps:
            return None
        return logit_fidelity([q[first:] for q in ours], [r[first:] for r in reference])

    recent = recent_slots(config.context)
    results = []
    for bits in kv_bits:
        quantization = KVQuantization.of(bits)
        ours = [np.array(a) for a in teacher_forced_logits(lm, inputs, previous, quantization)]
        results.append(
            {
                "impl": "ours",
                "kv": f"{bits}-bit",
                "dtype": dtype_label(dtype, lm),
                "steps": steps,
                "all_steps": figures(ours, 0),
                "recent_slots": recent,
                "past_recent": figures(ours, recent),
            }
        )
    return results


def _fidelity_notes(label: str, data: dict, case: dict) -> list[str]:
    lines = []
    for span in ("all_steps", "past_recent"):
        if data.get(span) is not None:
            fig = data[span]
            text, audio = fig["agreement"]
            lines.append(
                f"  {label} {span} of {data['steps']}: relative logit error text "
                f"{fig['text_error']:.2e}, depformer {fig['audio_error']:.2e}; greedy "
                f"agreement {text:.1%} / {audio:.1%}"
            )
    return lines


PART = Part(
    "kv-fidelity",
    lambda args, folder: kv_cases(args, folder, "kv-fidelity", bench_kv_fidelity),
    label=kv_label,
    notes=_fidelity_notes,
)
