"""The `ops` part: the operations of one step in each form (`form.FORMS`: as this backend
builds it, as MLX's CUDA backend does, as Metal does), by kind, without timing anything: the
step Moshi's `ChatStepper` runs (shapes with a depformer), the STT's `SttStepper` step (`stt-*`)
and the TTS's full frame (`tts-*` shapes of `--shapes`). Counted in bf16 compute, as a GPU
loads the files, for `--dtype auto`. Printed as lines of its own, outside the table."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.testing.checkpoints import load_lm

from ..form import FORMS
from ..part import Part
from ..shapes import DTYPES, LM_SHAPES, TTS_SHAPES, dtype_label, lm_shapes
from ..step_ops import step_for, step_ops
from ..timing import fresh_memory
from ..weights import lm_weights, tts_lm_file, tts_weights


def count_forms(lm_file: Path, config: LmConfig, dtype: mx.Dtype | None) -> dict:
    """The model's step counted in every form: {"dtype": ..., form: {"ops", "by_kind"}}."""
    fresh_memory()
    lm = load_lm(lm_file, config, dtype=dtype or mx.bfloat16)
    result = {"dtype": dtype_label(dtype or mx.bfloat16, lm)}
    result.update({form: step_ops(lm, form, step_for(lm)) for form in FORMS})
    return result


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per LM and TTS shape of `--shapes`, quant and dtype."""
    for shape in [*lm_shapes(args.shapes), *(s for s in args.shapes if s in TTS_SHAPES)]:
        for quant in args.quant:
            if shape in TTS_SHAPES:
                tts_dir = tts_weights(folder, shape, voices=1)
                lm_file = tts_lm_file(tts_dir, quant)
                config = LmConfig.from_dict(json.loads((tts_dir / CONFIG_FILE).read_text()))
            else:
                lm_file = lm_weights(folder, shape, quant)
                config = LmConfig.from_dict(LM_SHAPES[shape])
            for dtype in args.dtype:
                ours = count_forms(lm_file, config, DTYPES[dtype])
                yield {"part": "ops", "shape": shape, "quant": quant, "ours": ours}


def summary(case: dict) -> str:
    """One line per form: the step's operations, then by kind."""
    ours, lines = case["ours"], []
    for form in FORMS:
        kinds = ", ".join(f"{name} {count}" for name, count in ours[form]["by_kind"].items())
        head = f"ops {case['shape']} {case['quant']} {ours['dtype']} {form} form"
        lines.append(f"{head}: {ours[form]['ops']} per step ({kinds})")
    return "\n".join(lines)


PART = Part("ops", cases, summary=summary)
