"""`--suite gpu`: every figure that needs a GPU, on the full published shapes, in one run that
writes one JSON file (`-o FILE.json`), so that a session lent a GPU fills them all in with one
call. `--tiny` runs the same figures on tiny shapes and few steps (the tests). With `--kyutai`
(and `--kyutai-python`), the TTS, STT and Moshi steps are measured beside Kyutai's
`moshi_mlx` on the same files, and their summaries hold Kyutai's p50s and ours over them.

Each figure is a bench run with its own flags; the report keeps, per figure, those flags,
its cases (as a plain run's JSON) and a summary of the numbers it is for. The file is
rewritten after each figure, so a run cut short keeps the figures it finished; a figure that
fails is reported with its error and the suite goes on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cli import parse_args
from .runner import machine, run
from .tables import final_table


@dataclass(frozen=True)
class Figure:
    """A figure of a suite: the bench flags that measure it on the published shapes, the same
    on tiny shapes (`--tiny`), the numbers its summary keeps from its cases, and whether
    Kyutai's side is measured beside ours with the suite's `--kyutai`."""

    name: str
    flags: str
    tiny: str
    summary: Callable[[list[dict]], dict]
    kyutai: bool = False


def _p50s(result: dict, *metrics: str) -> dict:
    return {f"{m}_p50": result[m]["p50"] for m in metrics if result.get(m) is not None}


def _against_kyutai(ours: dict, theirs: dict | None, *metrics: str) -> dict:
    """Kyutai's p50 of each metric both measured (`kyutai_{metric}_p50`) and ours over it
    (`{metric}_over_kyutai`); nothing without Kyutai's result."""
    figures = {}
    for metric in metrics:
        if theirs is None or not ours.get(metric) or not theirs.get(metric):
            continue
        figures[f"kyutai_{metric}_p50"] = theirs[metric]["p50"]
        figures[f"{metric}_over_kyutai"] = ours[metric]["p50"] / theirs[metric]["p50"]
    return figures


def _lm_step(cases: list[dict]) -> dict:
    """The step, and its overhead: host time outside evaluation, syncs, graph operations
    (compiled here and in each GPU's form), the bytes it reads, its late steps and what
    happened in them; beside Kyutai's where run."""
    case = cases[0]
    ours = case["ours"]
    metrics = ("step_ms", "temporal_ms", "depformer_ms")
    figures = _p50s(ours, *metrics, "host_ms", "eval_ms")
    figures["step_ms_p95"] = ours["step_ms"]["p95"]
    figures.update(
        dtype=ours["dtype"],
        syncs_per_step=ours["syncs_per_step"],
        graph_ops=ours["graph_ops"],
        bytes=ours.get("bytes"),
        late_steps=ours.get("late_steps"),
        peak_memory_gb=ours["peak_memory_gb"],
    )
    figures.update(_against_kyutai(ours, case.get("kyutai"), *metrics))
    return figures


def _frame(cases: list[dict]) -> dict:
    """Encode, LM step and decode per 80 ms frame, with MLX's Mimi."""
    ours = cases[0]["ours"]
    figures = _p50s(ours, "frame_ms", "host_ms")
    for key in ("syncs_per_frame", "real_time_factor", "first_audio_ms", "peak_memory_gb"):
        figures[key] = ours[key]
    return figures


def _realtime(cases: list[dict]) -> dict:
    """/v1/realtime: speech end -> speech_stopped and -> first audio delta (tiny cascade), the
    socket and event layer per delta, and Moshi's mic frame -> reply frame through the socket."""
    case = cases[0]
    turns = case["ours"]["turns"]
    return {
        "speech_stopped_ms_median": float(np.median([t["speech_stopped"] for t in turns])),
        "first_audio_delta_ms_median": float(np.median([t["first_audio_delta"] for t in turns])),
        "socket_ms_median": case["ours"]["socket_ms_median"],
        "duplex_layer_ms_median": case["duplex_layer"]["round_trip_ms_median"],
        **{f"moshi_{key}": value for key, value in case["moshi"].items()},
    }


def _stt_batch(cases: list[dict]) -> dict:
    """ms per step and audio per second, 1 stream and the batch, at both windows."""
    ours = cases[0]["ours"]
    return {key: value for key, value in ours.items() if key != "ld_preload"}


def _persona_prefill(cases: list[dict]) -> dict:
    """The prompt's prefill (ms, and in conversation steps), the replay it replaces, the step
    against Moshi's and the cached starts."""
    ours = cases[0]["ours"]
    metrics = ("prefill_ms", "replay_ms", "step_ms", "moshi_step_ms")
    figures = _p50s(ours, *metrics, "start_mem_ms", "start_disk_ms")
    figures.update(
        prompt_runs=ours["prompt"]["runs"],
        prefill_steps=ours["ratios"]["prefill_ms"],
        replay_steps=ours["ratios"]["replay_ms"],
        personaplex_over_moshi_step=ours["ratios"]["step_ms"],
        peak_memory_gb=ours["peak_memory_gb"],
    )
    return figures


def _tts_rtf(cases: list[dict]) -> dict:
    """Per quantization (key prefix `bf16_`, `q8_`, `q4_`): the real-time factor at batch 1,
    audio per second of each batch, first audio, the LM step and Mimi's decoding; beside
    Kyutai's where run (bf16)."""
    figures = {}
    for case in cases:
        ours, quant = case["ours"], case["quant"]
        one = {"dtype": ours["dtype"]}
        for batch in case["batches"]:
            one[f"audio_per_s_b{batch}"] = ours[f"audio_per_s_b{batch}"]
            one.update(_p50s(ours, f"ttfa_ms_b{batch}", f"frame_ms_b{batch}"))
            one.update(_p50s(ours, f"step_ms_b{batch}", f"decode_ms_b{batch}"))
        one["real_time_factor_b1"] = ours["real_time_factor_b1"]
        one["peak_memory_gb"] = ours["peak_memory_gb"]
        theirs = case.get("kyutai")
        one.update(_against_kyutai(ours, theirs, "step_ms_b1", "frame_ms_b1", "ttfa_ms_b1"))
        if theirs is not None and theirs.get("real_time_factor_b1"):
            one["kyutai_real_time_factor_b1"] = theirs["real_time_factor_b1"]
        figures.update({f"{quant}_{key}": value for key, value in one.items()})
    return figures


GPU_SUITE = (
    Figure(
        "tts_real_time_factor",
        "--parts tts --shapes tts-1.6b --quant bf16,q8,q4 --streams 2 --steps 50 --warmup 5",
        "--parts tts --shapes tts-tiny --quant bf16,q8,q4 --streams 2 --steps 2 --warmup 1",
        _tts_rtf,
        kyutai=True,
    ),
    Figure(
        "stt_batch_8_vs_1",
        "--parts stt --shapes stt-1b --quant bf16 --codec mlx --streams 8 --steps 50",
        "--parts stt --shapes stt-tiny --quant bf16 --codec mlx --streams 2 --steps 2",
        _stt_batch,
    ),
    Figure(
        "moshi_7b_q4_step",
        "--parts lm --shapes 7b --quant q4 --steps 100 --split-steps 50 --warmup 10",
        "--parts lm --shapes tiny --quant q4 --steps 3 --split-steps 2 --warmup 1",
        _lm_step,
        kyutai=True,
    ),
    Figure(
        "stt_1b_step",
        "--parts lm --shapes stt-1b --quant bf16 --steps 100 --warmup 10",
        "--parts lm --shapes stt-tiny --quant bf16 --steps 3 --warmup 1",
        _lm_step,
        kyutai=True,
    ),
    Figure(
        "moshi_7b_q4_frame",
        "--parts pipeline --shapes 7b --quant q4 --codec mlx --frames 100 --warmup 10",
        "--parts pipeline --shapes tiny --quant q4 --codec mlx --frames 3 --warmup 1",
        _frame,
    ),
    Figure(
        "realtime_latency",
        "--parts realtime --shapes 7b --quant q4 --turns 3",
        "--parts realtime --shapes tiny --quant bf16 --turns 1",
        _realtime,
    ),
    Figure(
        "personaplex_prefill_300",
        "--parts persona --shapes 7b --quant q4 --prompt-steps 300 --steps 20 --warmup 3",
        "--parts persona --shapes tiny --quant q4 --prompt-steps 40 --replay-steps 10 "
        "--steps 2 --warmup 1 --persona-rounds 1",
        _persona_prefill,
    ),
)
SUITES = {"gpu": GPU_SUITE}  # by the names of `--suite`


def run_suite(args: argparse.Namespace) -> list[dict]:
    """Run `args.suite`'s figures (tiny with `args.tiny`) on one weights folder, writing the
    report to `args.json` after each; every figure's cases."""
    report = {
        "machine": machine(),
        "suite": args.suite,
        "shapes": "tiny" if args.tiny else "published",
        "figures": {},
    }
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.weights_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for figure in SUITES[args.suite]:
            flags = (figure.tiny if args.tiny else figure.flags).split()
            flags += ["--seed", str(args.seed)]
            if args.kyutai and figure.kyutai:
                flags += ["--kyutai", "--kyutai-python", args.kyutai_python]
            print(f"\n{figure.name}: {' '.join(flags)}", flush=True)
            entry: dict = {"flags": flags}
            started = time.perf_counter()
            try:
                cases = run(parse_args(flags), folder)
                entry.update(summary=figure.summary(cases), results=cases)
                results += cases
                print(final_table(cases))
            except Exception as error:  # noqa: BLE001 (a figure's failure, memory..., ends it alone)
                traceback.print_exc()
                entry["error"] = f"{type(error).__name__}: {error}"
            entry["seconds"] = time.perf_counter() - started
            report["figures"][figure.name] = entry
            if args.json is not None:
                args.json.write_text(json.dumps(report, indent=2))
    return results
