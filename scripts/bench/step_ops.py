"""The operations of a step, counted in each form (`form.FORMS`): Moshi's `ChatStepper` step,
the STT's `SttStepper` step and the TTS's full frame (`TtsStepper`, depformer included), each
the next step of a fresh stepper whose state is evaluated (its zeros are no operations),
compiled as a step runs."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.models.lm import Lm
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.tts.stepper import TtsStepper

from .form import kernel_form
from .shapes import DTYPE_NAMES
from .timing import ops_by_primitive
from .weights import TTS_VOICE_FRAMES

GPU_FORMS = ("cuda", "metal")  # counted beside this backend's own form

StepGraph = Callable[[], object]  # a stepper's next step, lazily


def moshi_step(lm: Lm) -> tuple[object, StepGraph]:
    """A fresh `ChatStepper` (default sampling) and its next step on zero user codes."""
    gen = ChatStepper(lm, seed=0)
    codes = np.zeros((lm.config.n_q - lm.config.moshi_codebooks,), np.int32)
    return gen, lambda: gen.step_graph(codes)


def stt_step(lm: Lm) -> tuple[object, StepGraph]:
    """A fresh `SttStepper` of one stream and its next step on zero audio codes."""
    stepper = SttStepper(lm)
    codes = np.zeros((1, lm.config.n_q), np.int32)
    return stepper, lambda: stepper.step_graph(codes)


def tts_frame(lm: Lm, full: bool = True) -> tuple[TtsStepper, StepGraph]:
    """A fresh `TtsStepper` on zero conditions and voices and its next frame: with the
    depformer (`full`), or the temporal step and text alone (the first `delay_steps` frames)."""
    config = lm.config
    dtype = lm.out_norm.weight.dtype
    condition = mx.zeros((1, config.dim), dtype)
    cross = lm.transformer.cross_keys_values(mx.zeros((1, TTS_VOICE_FRAMES, config.dim), dtype))
    mx.eval(condition, cross)
    stepper = TtsStepper(lm, condition, cross, delay_steps=0)
    choices = (mx.array([0], mx.int32), mx.array([3], mx.int32))

    def graph():
        out = stepper.graph(condition, cross, *choices, depformer=full)
        return [out.state, out.text, out.frame]

    return stepper, graph


def step_for(lm: Lm) -> Step:
    """The step a model runs: the TTS frame (cross-attention), Moshi's (a depformer), else
    the STT's."""
    if lm.config.cross_attention:
        return tts_frame
    return moshi_step if lm.config.dep_q else stt_step


Step = Callable[[Lm], tuple[object, StepGraph]]  # `moshi_step`, `stt_step`, `tts_frame`


def next_step(lm: Lm, step: Step) -> object:
    """The lazy next step of a fresh `step(lm)` stepper, its state evaluated first."""
    stepper, graph = step(lm)
    mx.eval(stepper._state)
    return graph()


def step_ops(lm: Lm, form: str, step: Step) -> dict:
    """The operations of `step(lm)`'s next step in `form`, by kind (`ops_by_primitive`), and
    the compute dtype they are counted in (a GPU's is bf16; float32 compute has no casts):
    {"ops": total, "by_kind": {...}, "dtype": "bf16" | "f32" | ...}."""
    with kernel_form(form) as tags:
        by_kind = ops_by_primitive(next_step(lm, step), tags)
    dtype = DTYPE_NAMES.get(lm.out_norm.weight.dtype, str(lm.out_norm.weight.dtype))
    return {"ops": sum(by_kind.values()), "by_kind": by_kind, "dtype": dtype}


def gpu_form_ops(lm: Lm, step: Step | None = None) -> dict:
    """`step_ops` in each of `GPU_FORMS`, by form (`step`: `step_for(lm)` when None)."""
    step = step or step_for(lm)
    return {form: step_ops(lm, form, step) for form in GPU_FORMS}


def form_lines(graph_ops: dict) -> list[str]:
    """Printed lines of the GPU forms' counts in `graph_ops["gpu_forms"]` (none without)."""
    lines = []
    for form, counted in graph_ops.get("gpu_forms", {}).items():
        kinds = ", ".join(f"{name} {count}" for name, count in counted["by_kind"].items())
        head = f"  {form} form ({counted['dtype']} compute): {counted['ops']} compiled ops"
        lines.append(f"{head} ({kinds})")
    return lines
