"""The `lm` part: ms per LM step, the whole step as `ChatStepper.step` runs it, and its split into
temporal transformer + text sampling / depformer + audio sampling / the 9 samplers alone; the
step's anatomy (host time, evaluation, syncs, graph operations); with `--kyutai`, Kyutai's
`moshi_mlx` on the same file, alternating with ours, `--rounds` times. A shape without a
depformer (`stt-*`) times the STT step instead: ours `SttStepper.step`, Kyutai's
`LmGen.step_with_extra_heads`."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_stats import LM_METRICS, lm_result, pool_rounds

from moshi_mlx.chat.generate import AUDIO_SAMPLING, TEXT_SAMPLING, ChatStepper
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.testing.checkpoints import load_lm

from ..floor import step_floor
from ..kyutai import run_kyutai
from ..part import Part
from ..shapes import DTYPES, LM_SHAPES, dtype_label, lm_shapes, user_codes
from ..steady import StepEvents, late_line, late_steps
from ..step_ops import form_lines, gpu_form_ops, moshi_step, stt_step
from ..timing import (
    SyncMeter,
    compiled_temporal_step,
    count_graph_ops,
    fresh_memory,
    ops_by_primitive,
    peak_gb,
    read_chat_step,
    syncs_per_frame,
)
from ..weights import lm_weights


def _split_times(lm: Lm, total: int, seed: int) -> dict[str, list]:
    """Per step, each part evaluated on its own (so the two add up to a step plus one host
    sync): the temporal transformer with the text head (compiled over a `KVRing`, as in a
    step), then `ChatStepper.sample_tokens` (text sampling and the depformer's 8 slices with audio
    sampling, compiled as in a step)."""
    config = lm.config
    gen = ChatStepper(lm, seed=seed)
    compiled_temporal = compiled_temporal_step(lm)
    ring = lm.make_ring()
    rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    temporal, depformer = [], []
    for index in range(total):
        tokens = np.concatenate(
            [rng.integers(0, config.text_card, 1), rng.integers(0, config.card, config.n_q)]
        )
        tokens = mx.array(tokens.astype(np.int32))[None, :, None]
        ring = ring.grown(index)
        mx.eval(tokens, ring.keys, ring.values)
        t0 = time.perf_counter()
        out, text_logits, keys, values, position = compiled_temporal(
            tokens, ring.keys, ring.values, ring.position
        )
        ring = KVRing(keys, values, position, config.context)
        mx.eval(out, text_logits, keys, values, position)
        t1 = time.perf_counter()
        generated, key = gen.sample_tokens(out, text_logits, key)
        mx.eval(generated, key)
        temporal.append(t1 - t0)
        depformer.append(time.perf_counter() - t1)
    return {"temporal": temporal, "depformer": depformer}


def _sampling_times(
    config: LmConfig, text_sampling: Sampling, audio_sampling: Sampling, total: int
) -> list[float]:
    """The text sampler and the 8 audio samplers alone, on logits of the real shapes."""
    times = []
    keys = mx.random.split(mx.random.key(1), 1 + config.dep_q)
    for _ in range(total):
        text_logits = mx.random.normal((1, config.text_card)).astype(mx.bfloat16)
        audio_logits = mx.random.normal((config.dep_q, 1, config.card)).astype(mx.bfloat16)
        mx.eval(text_logits, audio_logits)
        t0 = time.perf_counter()
        tokens = [text_sampling.sample(text_logits, keys[0])]
        tokens += [audio_sampling.sample(audio_logits[k], keys[1 + k]) for k in range(config.dep_q)]
        mx.eval(tokens)
        times.append(time.perf_counter() - t0)
    return times


def _step_anatomy(lm: Lm, total: int, seed: int) -> dict:
    """Where a step's time goes, per step as a caller runs it (`ChatStepper.step`, then its text
    token and Moshi's codes read on the host): host time outside evaluation (Python and
    graph building), time in evaluation (launching it and waiting for it), syncs; and the
    operations in the step's graph before and after `mx.compile` (`ChatStepper.step_graph` at the
    last step's state), and compiled in each GPU's form (`step_ops.gpu_form_ops`)."""
    gen = ChatStepper(lm, seed=seed)
    user = [
        mx.array(codes)
        for codes in user_codes(lm.config.card, total, seed, lm.config.num_user_codebooks)
    ]
    mx.eval(user)
    host, wait, syncs = [], [], []
    with SyncMeter() as meter:
        for codes in user:
            meter.new_frame()
            syncs_before, wait_before = meter.syncs, meter.wait_s
            t0 = time.perf_counter()
            result = gen.step(codes)
            read_chat_step(result)
            elapsed = time.perf_counter() - t0
            wait.append(meter.wait_s - wait_before)
            host.append(elapsed - wait[-1])
            syncs.append(meter.syncs - syncs_before)
    compiled = gen.step_graph(user[0], compiled=True)
    graph_ops = {
        "eager": count_graph_ops(gen.step_graph(user[0], compiled=False)),
        "compiled": count_graph_ops(compiled),
        "compiled_by_kind": ops_by_primitive(compiled),
        "gpu_forms": gpu_form_ops(lm, moshi_step),
    }
    return {"host": host, "eval": wait, "syncs": syncs, "graph_ops": graph_ops}


def bench_lm(
    weights: Path,
    shape: str,
    steps: int,
    warmup: int,
    seed: int,
    split_steps: int,
    dtype: mx.Dtype | None = None,
) -> dict:
    """Our `ChatStepper.step` per step (p50/p95), its split, first audio step, peak memory, and its
    late steps with what happened in them (`steady.late_steps`).

    `dtype` is the compute dtype (activations, norms, quantization scales): bf16 as
    Kyutai's loader, float32, or None for `load_lm`'s choice for the device.
    """
    fresh_memory()
    config = LmConfig.from_dict(LM_SHAPES[shape])
    start = time.perf_counter()
    lm = load_lm(weights, config, dtype=dtype)
    load_s = time.perf_counter() - start
    total = warmup + steps

    mx.reset_peak_memory()
    gen = ChatStepper(lm, seed=seed)
    step_times, first_audio_step = [], None
    with StepEvents(lambda: gen.ring.capacity) as events:
        for index, codes in enumerate(
            user_codes(config.card, total, seed, config.num_user_codebooks)
        ):
            events.before()
            t0 = time.perf_counter()
            result = gen.step(codes)
            _, moshi_codes = read_chat_step(result)  # on the host, as a caller
            step_times.append(time.perf_counter() - t0)
            events.after()
            if moshi_codes is not None and first_audio_step is None:
                first_audio_step = index
    peak = peak_gb()

    samples = {"step_ms": step_times[warmup:]}
    anatomy = {}
    if split_steps > 0:
        split = _split_times(lm, warmup + split_steps, seed)
        anatomy = _step_anatomy(lm, warmup + split_steps, seed)
        samples.update(
            temporal_ms=split["temporal"][warmup:],
            depformer_ms=split["depformer"][warmup:],
            sampling_ms=_sampling_times(
                config, TEXT_SAMPLING, AUDIO_SAMPLING, warmup + split_steps
            )[warmup:],
            host_ms=anatomy["host"][warmup:],
            eval_ms=anatomy["eval"][warmup:],
        )
    return {
        "impl": "ours",
        "dtype": dtype_label(dtype, lm),
        "mlx": mx.__version__,
        "load_s": load_s,
        **lm_result(samples),
        "syncs_per_step": float(np.mean(anatomy["syncs"][warmup:])) if anatomy else None,
        "bytes": step_floor(lm, 1000 * float(np.median(step_times[warmup:]))),
        "late_steps": late_steps([1000 * s for s in step_times[warmup:]], events.per_step[warmup:]),
        "graph_ops": anatomy.get("graph_ops"),
        "first_audio_step": first_audio_step,
        "peak_memory_gb": peak,
    }


def bench_listen(
    weights: Path, shape: str, steps: int, warmup: int, seed: int, dtype: mx.Dtype | None = None
) -> dict:
    """Our STT step (a shape without a depformer) as `SttModel` takes it: `SttStepper.step`
    on one frame of audio codes, then its text token and heads' probabilities on the host;
    per step (p50/p95), peak memory, the host syncs per step over `warmup` more steps (none
    without a warm-up) and the step's graph operations (eager, compiled, compiled by kind,
    and compiled in each GPU's form)."""
    fresh_memory()
    config = LmConfig.from_dict(LM_SHAPES[shape])
    start = time.perf_counter()
    lm = load_lm(weights, config, dtype=dtype)
    load_s = time.perf_counter() - start
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, config.card, (warmup + steps, 1, config.n_q)).astype(np.int32)
    mx.reset_peak_memory()
    stepper = SttStepper(lm)
    step_times = []
    for frame in codes:
        t0 = time.perf_counter()
        out = stepper.step(frame)
        _ = np.array(out.text).tolist(), np.array(out.head_probabilities)
        step_times.append(time.perf_counter() - t0)
    peak = peak_gb()

    def read_in_one_wait(frame: np.ndarray) -> None:  # the token and the heads
        out = stepper.step(frame)
        mx.eval(out.text, out.head_probabilities)
        _ = np.array(out.text).tolist(), np.array(out.head_probabilities)

    compiled = stepper.step_graph(codes[0])
    graph_ops = {
        "eager": count_graph_ops(stepper.step_graph(codes[0], compiled=False)),
        "compiled": count_graph_ops(compiled),
        "compiled_by_kind": ops_by_primitive(compiled),
        "gpu_forms": gpu_form_ops(lm, stt_step),
    }
    return {
        "impl": "ours",
        "dtype": dtype_label(dtype, lm),
        "mlx": mx.__version__,
        "load_s": load_s,
        **lm_result({"step_ms": step_times[warmup:]}),
        "syncs_per_step": syncs_per_frame(codes[:warmup], read_in_one_wait),
        "bytes": step_floor(lm, 1000 * float(np.median(step_times[warmup:]))),
        "graph_ops": graph_ops,
        "first_audio_step": None,
        "peak_memory_gb": peak,
    }


def _bench_ours(args: argparse.Namespace, weights: Path, shape: str, dtype: str) -> dict:
    """Ours on one case: the STT step for a shape without a depformer, else `bench_lm`."""
    if LM_SHAPES[shape]["dep_q"] == 0:
        return bench_listen(weights, shape, args.steps, args.warmup, args.seed, DTYPES[dtype])
    return bench_lm(
        weights, shape, args.steps, args.warmup, args.seed, args.split_steps, DTYPES[dtype]
    )


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per LM shape, quant and dtype of ours: `--rounds` rounds of ours (and Kyutai's first in
    each round, with `--kyutai`), statistics over the rounds' samples."""
    common = ["--warmup", str(args.warmup), "--seed", str(args.seed)]
    for shape in lm_shapes(args.shapes):
        for quant in args.quant:
            weights = lm_weights(folder, shape, quant)
            extra = ["--shape", shape, "--steps", str(args.steps), *common]
            extra += ["--split-steps", str(args.split_steps)]
            theirs_runs, ours_runs = [], {dtype: [] for dtype in args.dtype}
            for _ in range(args.rounds):  # alternate: theirs, ours, theirs, ours...
                if args.kyutai:
                    theirs_runs.append(run_kyutai(args.kyutai_python, "lm", weights, extra))
                for dtype in args.dtype:
                    ours_runs[dtype].append(_bench_ours(args, weights, shape, dtype))
            theirs = pool_rounds(theirs_runs) if theirs_runs else None
            for dtype in args.dtype:
                case = {"part": "lm", "shape": shape, "quant": quant, "kyutai": theirs}
                case["ours"] = pool_rounds(ours_runs[dtype])
                yield case


def _anatomy_notes(label: str, data: dict, case: dict) -> list[str]:
    """Syncs per step where measured; the step's graph operations, the compiled ones by kind
    and in each GPU's form; where its bytes are."""
    ops = data.get("graph_ops")
    if ops is None:
        return []
    line = f"graph ops per step {ops['eager']} eager, {ops['compiled']} compiled"
    if data.get("syncs_per_step") is not None:
        line = f"syncs per step {data['syncs_per_step']:.2f}, {line}"
    kinds = ", ".join(f"{name} {count}" for name, count in ops.get("compiled_by_kind", {}).items())
    lines = [f"  {line}"] + ([f"  compiled by kind: {kinds}"] if kinds else []) + form_lines(ops)
    late = [late_line(data["late_steps"])] if data.get("late_steps") else []
    return lines + _bytes_lines(data) + late


def _bytes_lines(data: dict) -> list[str]:
    """Where the step's bytes are, and its ratio to the floor they imply on this machine."""
    read = data.get("bytes")
    if read is None:
        return []
    line = f"  reads {read['weights_gb']:.3f} GB of weights and {read['kv_gb']:.3f} GB of KV "
    line += f"cache (full context) a step: {read['floor_ms']:.2f} ms at this machine's "
    line += f"{read['machine_gbs']:.1f} GB/s; the step is {read['step_over_floor']:.1f}x that floor"
    return [line]


PART = Part("lm", cases, metrics=lambda case: LM_METRICS, notes=_anatomy_notes)
