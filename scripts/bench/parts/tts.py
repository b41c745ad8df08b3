"""The `tts` part: Kyutai's text-to-speech, `moshi_mlx.tts`, on random weights of a `tts-*`
shape written in the published PyTorch layout with a tokenizer and voices (`tts_weights`): per
batch of 1 and `--streams` requests, the time to the first audio (`ttfa_ms`: from making the
requests with their whole texts to the first 80 ms returned, in voices the model used before;
`ttfa_new_voice_ms`: the same requests after the model's voice cache was cleared, their voice
files read and projected; `ttfd_ms`: to the first frame Mimi decoded, which Kyutai's reference
cuts with the next one), and per step past it the whole
`TtsRun.step` (`frame_ms`), its LM part (`step_ms`: step, text schedule) and Mimi's decoding
(`decode_ms`); real-time factor at batch 1, audio per second of the batch against batch 1.
Per `--quant`: the published bf16 file, or q8/q4 files our quantizer made from it (loaded as
a user's would be, with no extra option). With `--kyutai`, Kyutai's `TTSModel.generate` on the
same bf16 files, its frames decoded as they come (beside the bf16 case only); `--shapes`
without a tts shape: tts-small."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from bench_stats import TTS_TEXTS, pool_tts, summarize, tts_result

from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun

from ..floor import op_costs_us
from ..kyutai import run_kyutai
from ..part import Part
from ..shapes import DTYPES, dtype_label, tts_shapes
from ..step_ops import form_lines, gpu_form_ops, next_step, tts_frame
from ..timing import fresh_memory, ops_by_primitive, peak_gb, syncs_per_frame
from ..weights import TTS_TOKENIZER, mimi_weights, tts_lm_file, tts_weights


class _TimedMimi:
    """A Mimi whose `decode_step`s are timed, each from its codes' evaluation (the LM step's
    work, not Mimi's) to its pcm's; everything else is the Mimi's own."""

    def __init__(self, mimi):
        self.mimi = mimi
        self.decodes: list[tuple[float, float]] = []  # (start, end) of each decode_step

    def __getattr__(self, name: str):
        return getattr(self.mimi, name)

    def with_codebooks(self, num_codebooks: int, bins: int | None = None) -> _TimedMimi:
        """The Mimi a TTS of `num_codebooks` (and card `bins`) decodes with, timed into the
        same list (`Mimi.with_codebooks`)."""
        view = self.mimi.with_codebooks(num_codebooks, bins)
        if view is self.mimi:
            return self
        timed = _TimedMimi(view)
        timed.decodes = self.decodes
        return timed

    def decode_step(self, codes: mx.array, state):
        mx.eval(codes)
        start = time.perf_counter()
        pcm = self.mimi.decode_step(codes, state)
        mx.eval(pcm)
        self.decodes.append((start, time.perf_counter()))
        return pcm


def _tts_run(model: TtsModel, folder: Path, batch: int, steps: int, seed: int) -> dict:
    """`batch` requests (text and voice b for request b) through `TtsRun.step` (the LM step,
    the text schedule, Mimi's decoding and the audio on the host), from making the requests
    to `steps` steps past the first audio. Seconds: `ttfa` to the first 80 ms of audio
    returned (Kyutai's first `SKIPPED_FRAMES` frames are decoded but cut), `ttfd` to the
    first frame decoded, per step past the first audio the whole step (`frame`) and Mimi's
    decoding in it (`decode`); `first_step`: the steps run at the first audio. `steps` 0:
    to the first audio only."""
    mimi = model.codec.model
    mimi.decodes.clear()
    start = time.perf_counter()
    voices = [folder / "voices" / f"voice{b}.safetensors" for b in range(batch)]
    requests = [TtsRequest(TTS_TEXTS[b], (voice,)) for b, voice in enumerate(voices)]
    run = TtsRun(model, requests, seed=seed)
    for request, schedule in zip(requests, run.schedules):
        schedule.push(model.entries(request.text))
        schedule.close()
    ttfa, first_step, frame, decode = None, None, [], []
    while ttfa is None or len(frame) < steps:
        decoded = len(mimi.decodes)
        started = time.perf_counter()
        pcm = run.step().pcm
        ended = time.perf_counter()
        if ttfa is not None:
            frame.append(ended - started)
            decode.append(sum(e - s for s, e in mimi.decodes[decoded:]))
        elif any(p is not None for p in pcm):
            ttfa, first_step = ended - start, run.step_index
        if any(s.end_step is not None for s in run.schedules):  # texts as long as the bench
            raise RuntimeError(f"a request's text ended at step {run.step_index}")
    return {
        "ttfa": ttfa,
        "ttfd": mimi.decodes[0][1] - start,
        "frame": frame,
        "decode": decode,
        "first_step": first_step,
    }


def frame_anatomy(lm, steps: int = 8) -> dict:
    """One TTS frame's LM step as the stepper runs it, on zero conditions and voices: the
    operations of its compiled graph by primitive (`ops_by_primitive`: the temporal step, the
    text sampling and schedule choice, the depformer's slices with their sampling), those of
    the step without the depformer (`temporal_ops`: the first `delay_steps` frames' step), the
    host syncs per frame (`SyncMeter`) of a caller reading the predicted token and the frame
    in one evaluation, over `steps` steps past the audio delay, what one operation of each
    kind costs on this backend (`op_costs_us`), and the frame's operations in each GPU's form
    (`step_ops.gpu_form_ops`)."""
    stepper, full = tts_frame(lm)
    mx.eval(stepper._state)  # a step's state is evaluated: its zeros are no operations
    ops = ops_by_primitive(full())
    temporal = ops_by_primitive(next_step(lm, partial(tts_frame, full=False)))

    def frame(_) -> None:
        out = stepper.step([0], [3])
        mx.eval(out.text, out.frame)  # both in one wait
        _ = np.array(out.text), np.array(out.frame)

    return {
        "ops": sum(ops.values()),
        "ops_by_kind": ops,
        "temporal_ops": sum(temporal.values()),
        "slices": stepper.function.n_q,
        "syncs": syncs_per_frame(range(steps), frame),
        "op_costs_us": op_costs_us(),
        "gpu_forms": gpu_form_ops(lm, tts_frame),
    }


def bench_tts(
    folder: Path,
    lm_file: Path,
    mimi_file: Path,
    batches: list[int],
    steps: int,
    warmup: int,
    seed: int,
    dtype: mx.Dtype | None = None,
    model: TtsModel | None = None,
) -> tuple[dict, TtsModel]:
    """Our TTS on a `tts_weights` folder with its LM in `lm_file`, per batch size: a warm-up run (`warmup` steps past
    the first audio: every compiled step and ring size traced) on a fresh model, then a
    measured run (`_tts_run`, `tts_result`'s figures). Returns the result and the model (pass
    it back to measure again without the load and the warm-up)."""
    fresh = model is None
    if fresh:
        fresh_memory()
        config = LmConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
        lm = load_lm(lm_file, config, dtype=dtype)
        codec = SimpleNamespace(model=_TimedMimi(load_mimi(mimi_file, config.dep_q)))
        model = TtsModel(lm, codec, load_tokenizer(folder / TTS_TOKENIZER), files=None)
    result = {"impl": "ours", "dtype": dtype_label(dtype, model.lm), "mlx": mx.__version__}
    result["frame_anatomy"] = frame_anatomy(model.lm)
    for batch in batches:
        if fresh:
            _tts_run(model, folder, batch, warmup, seed)
        fresh_memory()
        run = _tts_run(model, folder, batch, steps, seed)
        step = [f - d for f, d in zip(run["frame"], run["decode"])]
        figures = (run["ttfa"], run["ttfd"], run["first_step"], run["frame"], step, run["decode"])
        result.update(tts_result(batch, *figures, peak_gb()))
        model.voice_cache.clear()  # the same requests in voices the model has not used yet
        new_voice = _tts_run(model, folder, batch, 0, seed)["ttfa"]
        result[f"ttfa_new_voice_ms_b{batch}"] = summarize([new_voice])
        result[f"samples_ms_b{batch}"]["ttfa_new_voice"] = [1000 * new_voice]
    return result, model


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per TTS shape, `--quant` and dtype of ours, `--rounds` rounds of our TTS at batch 1
    and `--streams` and, with `--kyutai` and bf16, of Kyutai's on the same files (theirs
    first in each round, then ours: a slow spell of the machine hits both); statistics over
    the rounds' samples. Our model is loaded and warmed up once per case."""
    mimi_file = mimi_weights(folder)
    batches = sorted({1, args.streams})
    for shape in tts_shapes(args.shapes):
        tts_dir = tts_weights(folder, shape, max(batches))
        extra = ["--mimi", str(mimi_file), "--batches", ",".join(map(str, batches))]
        extra += [
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seed",
            str(args.seed),
        ]
        for quant in args.quant:
            lm_file = tts_lm_file(tts_dir, quant)
            kyutai = args.kyutai and quant == "bf16"
            theirs_runs, ours_runs = [], {dtype: [] for dtype in args.dtype}
            models: dict[str, TtsModel] = {}
            for _ in range(args.rounds):
                if kyutai:
                    theirs_runs.append(run_kyutai(args.kyutai_python, "tts", tts_dir, extra))
                for dtype in args.dtype:
                    ours, models[dtype] = bench_tts(
                        tts_dir, lm_file, mimi_file, batches, args.steps, args.warmup,
                        args.seed, DTYPES[dtype], models.get(dtype),
                    )  # fmt: skip
                    ours_runs[dtype].append(ours)
            models.clear()
            theirs = pool_tts(theirs_runs, batches) if theirs_runs else None
            for dtype in args.dtype:
                case = {"part": "tts", "shape": shape, "quant": quant, "batches": batches}
                case.update(ours=pool_tts(ours_runs[dtype], batches), kyutai=theirs)
                case["ld_preload"] = os.environ.get("LD_PRELOAD", "")
                yield case


# Rows of the `tts` part, per batch size (`tts_result`).
TTS_METRICS = ("ttfa_ms", "ttfa_new_voice_ms", "ttfd_ms", "frame_ms", "step_ms", "decode_ms")


def _anatomy_line(label: str, data: dict) -> str | None:
    """The LM step's compiled operations per frame, the main kinds, where they come from, its
    host syncs, and the cost of one operation of each kind here."""
    anatomy = data.get("frame_anatomy")
    if anatomy is None:
        return None
    kinds = ", ".join(f"{name} {count}" for name, count in list(anatomy["ops_by_kind"].items())[:8])
    line = (
        f"  {label}: LM step {anatomy['ops']} compiled ops per frame ({kinds}, ...), "
        f"{anatomy['syncs']:.2f} host syncs per frame"
    )
    if "temporal_ops" in anatomy:
        slices, temporal = anatomy["slices"], anatomy["temporal_ops"]
        per_slice = (anatomy["ops"] - temporal) / slices
        line += (
            f"; temporal step and text {temporal}, {slices} depformer slices {per_slice:.0f} each"
        )
    if "op_costs_us" in anatomy:
        costs = ", ".join(f"{kind} {us:.1f}" for kind, us in anatomy["op_costs_us"].items())
        line += f"\n  {label}: us per op here: {costs}"
    return "\n".join([line, *form_lines(anatomy)])


def _tts_line(label: str, data: dict, batches: list[int]) -> str:
    """The `tts` case's real-time factor at batch 1 and audio per second of each batch."""
    parts = []
    for batch in batches:
        if f"error_b{batch}" in data:
            parts.append(f"batch {batch} failed: {data[f'error_b{batch}']}")
            continue
        figure = f"batch {batch}: {data[f'audio_per_s_b{batch}']:.3f} s of audio/s"
        if batch == 1:
            figure = f"batch 1: real-time factor {data['real_time_factor_b1']:.3f}"
        elif "audio_per_s_b1" in data:
            figure += f" ({data[f'audio_per_s_b{batch}'] / data['audio_per_s_b1']:.2f}x batch 1)"
        parts.append(f"{figure}, first audio at step {data[f'first_audio_step_b{batch}']}")
    return f"  {label}: " + "; ".join(parts)


PART = Part(
    "tts",
    cases,
    metrics=lambda case: tuple(f"{m}_b{b}" for b in case["batches"] for m in TTS_METRICS),
    notes=lambda label, data, case: [
        line
        for line in (_tts_line(label, data, case["batches"]), _anatomy_line(label, data))
        if line
    ],
)
