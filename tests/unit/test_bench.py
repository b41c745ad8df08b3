"""Smoke test of scripts/bench.py (the scripts/bench package): the tiny shape, a few steps, sane
numbers in the JSON; its registry of parts and its GPU suite on tiny shapes."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import MANIFESTS, needs_kyutai

from moshi_mlx.models.lm import Lm, LmConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
STEPS, FRAMES = 6, 3


def _check_timing(stats: dict, count: int) -> None:
    assert stats["n"] == count
    assert 0 < stats["p50"] <= stats["p95"] < 60_000
    assert math.isfinite(stats["mean"]) and stats["mean"] > 0


def _run_bench(flags: str, out: Path, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """Run scripts/bench.py with `flags` (and `--json out`); its output and its JSON report."""
    command = [sys.executable, str(SCRIPTS / "bench.py"), *flags.split(), "--json", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    flags = (
        "--shapes tiny --quant bf16,q4 --parts lm,mimi,pipeline,echo,kv --kv-bits none "
        f"--codec mlx,rustymimi --steps {STEPS} --split-steps 3 --frames {FRAMES} --warmup 1 "
        "--batch-seconds 1"
    )
    done, results = _run_bench(flags, out, timeout=300)
    assert "step_ms" in done.stdout and "real-time factor" in done.stdout  # the printed table
    return results


def _cases(report: dict, part: str) -> list[dict]:
    return [case for case in report["results"] if case["part"] == part]


def test_lm_cases(report):
    cases = _cases(report, "lm")
    assert [(c["shape"], c["quant"]) for c in cases] == [("tiny", "bf16"), ("tiny", "q4")]
    for case in cases:
        ours = case["ours"]
        _check_timing(ours["step_ms"], STEPS)
        for part in ("temporal_ms", "depformer_ms", "sampling_ms"):
            _check_timing(ours[part], 3)
        # Moshi's delays (acoustic codebooks one step late): audio from the second step on.
        assert ours["first_audio_step"] == 1
        assert ours["syncs_per_step"] == 1.0
        assert 0 < ours["graph_ops"]["compiled"] < ours["graph_ops"]["eager"]
        _check_timing(ours["host_ms"], 3)
        assert ours["eval_ms"]["n"] == 3
        assert 0 < ours["peak_memory_gb"] < 2
        assert case["kyutai"] is None


def test_mimi_cases(report):
    cases = {c["ours"]["backend"]: c["ours"] for c in _cases(report, "mimi")}
    assert set(cases) == {"mlx", "rustymimi"}
    for result in cases.values():
        for part in ("encode_ms", "decode_ms", "frame_ms"):
            _check_timing(result[part], FRAMES)
        for part in ("batch_encode_ms", "batch_decode_ms"):  # 1 s of audio, twice
            _check_timing(result[part], 2)
        assert result["real_time_factor"] == pytest.approx(80.0 / result["frame_ms"]["p50"])
    assert cases["mlx"]["peak_memory_gb"] > 0.1  # the full-size codec's float32 weights


def test_pipeline_cases(report):
    cases = _cases(report, "pipeline")
    assert len(cases) == 4  # bf16/q4 x mlx/rustymimi
    for case in cases:
        ours = case["ours"]
        _check_timing(ours["frame_ms"], FRAMES)
        # The first audio frame needs two frames: one step fills the acoustic delay.
        assert ours["first_audio_ms"] >= ours["frame_ms"]["p50"] * 0.5
        assert ours["real_time_factor"] == pytest.approx(80.0 / ours["frame_ms"]["p50"])
        # One host synchronisation per frame with MLX Mimi (encode, LM step, decode evaluated
        # together); rustymimi moves the mic frame and Moshi's codes through the host.
        if ours["backend"] == "mlx":
            assert ours["syncs_per_frame"] == 1.0
        else:
            assert ours["syncs_per_frame"] > 1.0


def test_echo_case(report):
    (case,) = _cases(report, "echo")
    _check_timing(case["ours"]["frame_ms"], 100)  # at least 100 frames of 80 ms
    assert case["ours"]["frame_ms"]["p50"] < 40  # far below real time


def _bench_module(name: str):
    """A module of the scripts/bench package (`bench.{name}`)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(f"bench.{name}")
    finally:
        sys.path.remove(str(SCRIPTS))


def _manifest_bytes(manifest: Path) -> int:
    """Bytes of every tensor a published file's manifest lists."""
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "uint32": 4}
    total = 0
    for line in manifest.read_text().splitlines()[1:]:
        _, shape, dtype = line.split("\t")
        total += int(np.prod([int(d) for d in shape.split(",")])) * sizes[dtype]
    return total


def test_step_bytes_of_the_published_files():
    """A Moshi 7B step reads every tensor of the published files but the embedding tables'
    other rows (about 0.6 GB of bf16), and its KV cache; `--floor` shows them per chip."""
    floor = _bench_module("floor")
    read = {}
    for quant, bits in (("bf16", None), ("q8", 8), ("q4", 4)):
        read[quant], kv = floor.step_bytes(LmConfig.moshi_7b(), bits)
        total = _manifest_bytes(MANIFESTS / f"moshiko_mlx_{quant}.tsv")
        assert 0.9 * total < read[quant] < total
        assert kv / 1e9 == pytest.approx(1.57, abs=0.01)  # 32 layers x 2 x 3000 x 4096 bf16
    assert read["bf16"] / 1e9 == pytest.approx(14.75, abs=0.01)
    assert read["q4"] / 1e9 == pytest.approx(4.61, abs=0.01)
    assert read["q8"] / 1e9 == pytest.approx(7.84, abs=0.01)


def test_hibiki_zero_step_beside_moshis():
    """Hibiki-Zero 3B's step reads under half of Moshi 7B's bytes (its KV cache holds 8 key /
    value heads of 28 layers) but runs more operations (16 depformer slices, not 8)."""
    floor = _bench_module("floor")
    shape = floor._shape("hibiki-zero-3b")()
    weights, kv = floor.step_bytes(shape, 4)
    assert (round(weights / 1e9, 2), round(kv / 1e9, 2)) == (2.21, 0.34)
    zero = floor.metal_ops(floor._shape("hibiki-zero-3b-structure")(), 4)
    moshi = floor.metal_ops(floor._shape("7b-structure")(), 4)
    assert 1.4 < zero / moshi < 1.7


def test_op_costs_per_kind():
    """`op_costs_us` times one operation of each kind a step's graph counts, on this backend."""
    floor = _bench_module("floor")
    costs = floor.op_costs_us(count=20, repeats=1)
    assert {"Reshape", "AsType", "Compiled", "Sum", "Softmax", "Matmul"} <= set(costs)
    assert all(0 < us < 10_000 for us in costs.values())
    # The output head's product (64 x 2049) is work, not just dispatch.
    assert costs["Matmul 64x2049"] > costs["Reshape"]


def test_web_server_overhead(tmp_path):
    """The web server's own work per 80 ms frame (Opus both ways, a websocket round trip)."""
    _, report = _run_bench("--parts web --frames 10 --warmup 2", tmp_path / "web.json", 120)
    (case,) = report["results"]
    ours = case["ours"]
    for part in ("decode_ms", "encode_ms", "websocket_ms", "overhead_ms"):
        _check_timing(ours[part], 10)
    assert ours["overhead_ms"]["p50"] >= ours["encode_ms"]["p50"]
    assert 50 < ours["client_bytes_per_frame"] < 2000  # Ogg Opus pages of 80 ms


def test_lm_without_split_steps(tmp_path):
    """`--split-steps 0` measures whole steps only (the parts and the anatomy are skipped)."""
    flags = "--shapes tiny --quant bf16 --parts lm --steps 2 --split-steps 0 --warmup 0"
    _, report = _run_bench(flags, tmp_path / "bench.json", timeout=300)
    ours = report["results"][0]["ours"]
    _check_timing(ours["step_ms"], 2)
    assert ours["temporal_ms"] is None and ours["syncs_per_step"] is None


@needs_kyutai
def test_stt_step_beside_kyutai(tmp_path):
    """`--parts lm` on an STT shape times the STT step, ours (`ListenStepper`) and Kyutai's
    (`LmGen.step_with_extra_heads`) round by round, with our compiled operations by kind."""
    flags = "--shapes stt-tiny --quant bf16 --dtype bf16 --parts lm --steps 3 --warmup 1"
    done, report = _run_bench(f"{flags} --rounds 2 --kyutai", tmp_path / "b.json", timeout=300)
    (case,) = report["results"]
    ours, theirs = case["ours"], case["kyutai"]
    for result in (ours, theirs):
        _check_timing(result["step_ms"], 6)
        assert len(result["round_step_p50_ms"]) == 2
    ops = ours["graph_ops"]
    assert 0 < ops["compiled"] < ops["eager"]
    assert sum(ops["compiled_by_kind"].values()) == ops["compiled"]
    assert "compiled by kind" in done.stdout
    assert ours["syncs_per_step"] == 1.0 and "syncs per step 1.00" in done.stdout


def test_kv_case(report):
    """The KV part: the tiny LM's ring reserved at its full context, unquantized (its heads
    are too narrow for a quantized cache)."""
    (q4,) = [case for case in _cases(report, "kv") if case["quant"] == "q4"]
    data = q4["ours"]
    assert data["kv"] == "unquantized" and data["ratio"] == 1.0
    _check_timing(data["step_ms"], STEPS)
    assert 0 < data["planned_kv_gb"] < data["peak_memory_gb"]


def test_persona_case(tmp_path):
    """The PersonaPlex part: prompt phase, cached starts and PersonaPlex's step against
    Moshi's, on the tiny shape (a 40-step prompt, 10 of its steps replayed)."""
    flags = (
        "--shapes tiny --quant q4 --parts persona --steps 3 --warmup 1 --prompt-steps 40 "
        "--replay-steps 10 --persona-rounds 2"
    )
    done, report = _run_bench(flags, tmp_path / "persona.json", timeout=120)
    (case,) = report["results"]
    ours = case["ours"]
    for metric in ("step_ms", "moshi_step_ms"):
        _check_timing(ours[metric], 3)
    for metric in ("prefill_ms", "start_mem_ms", "start_disk_ms", "load_ms"):
        _check_timing(ours[metric], 2)
    _check_timing(ours["replay_step_ms"], 9)  # after the warm-up step
    # The replay extrapolated to the whole prompt from its median step.
    assert ours["replay_ms"]["p50"] == pytest.approx(40 * ours["replay_step_ms"]["p50"])
    prompt = dict(ours["prompt"])
    assert len(prompt.pop("prefill_measured_ms")) == 2
    assert prompt == {
        "runs": 40,
        "voice_frames": 28,
        "role_tokens": 1,
        "prefill_steps": 40,  # the whole prompt prefilled
        "replay_steps": 10,
        "replay_measured": 9,
        "replay_total_ms": None,
    }
    assert ours["start_disk_ms"]["p50"] > ours["load_ms"]["p50"] > 0
    assert ours["ratios"]["prefill_ms"] == pytest.approx(
        ours["prefill_ms"]["p50"] / ours["step_ms"]["p50"]
    )
    for name in ("personaplex", "moshi"):
        assert 0 < ours["graph_ops"][name]["compiled"] < ours["graph_ops"][name]["eager"]
        assert len(ours["samples_ms"][name]) == 3  # the alternated pairs, for re-analysis
    assert "prefill_ms" in done.stdout and "cached start" in done.stdout


def test_personaplex_config_of_the_7b_shape():
    persona = _bench_module("parts.persona")
    moshi = LmConfig.from_dict(persona.LM_SHAPES["7b"])
    assert moshi == LmConfig.moshi_7b()
    assert persona.personaplex_config(moshi) == LmConfig.personaplex_7b()


def test_partly_prefilled_prompt_state_has_the_whole_prompts_layout():
    """What `--prefill-steps` times (7B on a CPU): the prefill of the prompt's first runs,
    in a state with the whole prompt's tokens, positions and KV ring, as what follows needs."""
    persona = _bench_module("parts.persona")
    config = persona.personaplex_config(LmConfig.from_dict(persona.LM_SHAPES["tiny"]))
    lm = Lm(config)
    voice, role = persona.persona_prompt(config, 40, seed=0)
    _, whole = persona._timed_prompt_state(lm, voice, role)
    _, partial = persona._timed_prompt_state(lm, voice, role, prefilled=8)
    assert partial.step_index == whole.step_index == 40
    assert int(partial.ring.position) == int(whole.ring.position) == 40
    assert partial.ring.capacity == whole.ring.capacity
    np.testing.assert_array_equal(np.array(partial.tokens), np.array(whole.tokens))
    np.testing.assert_array_equal(np.array(partial.given), np.array(whole.given))
    for ours, reference in zip(partial.ring.keys, whole.ring.keys):
        np.testing.assert_allclose(
            np.array(ours[:, :, :8]), np.array(reference[:, :, :8]), rtol=1e-4, atol=1e-5
        )
        assert not np.array(ours[:, :, 8:40]).any()  # not computed: left zero


def test_tts_case(tmp_path):
    """The TTS part on the tiny TTS shape (the published streams, 64 wide, audio 4 steps
    behind the text), batches of 1 and 2 requests, bf16 and a q4 file made by our quantizer:
    our figures, Kyutai's not asked for."""
    flags = "--parts tts --shapes tts-tiny --quant bf16,q4 --streams 2 --steps 2 --warmup 1"
    flags += f" --weights-dir {tmp_path / 'weights'}"
    done, report = _run_bench(flags, tmp_path / "tts.json", timeout=240)
    bf16, q4 = report["results"]
    cases = [(c["shape"], c["quant"]) for c in (bf16, q4)]
    assert cases == [("tts-tiny", "bf16"), ("tts-tiny", "q4")]
    assert (tmp_path / "weights" / "tts-tiny" / "lm_q4.safetensors").exists()
    case = bf16
    assert (case["batches"], case["kyutai"]) == ([1, 2], None)
    ours = case["ours"]
    for batch in (1, 2):
        for metric in ("frame_ms", "step_ms", "decode_ms"):
            _check_timing(ours[f"{metric}_b{batch}"], 2)
        for metric in ("ttfa_ms", "ttfa_new_voice_ms", "ttfd_ms"):
            _check_timing(ours[f"{metric}_b{batch}"], 1)
        # 4 steps of text first, 2 of acoustic delay, 2 decoded frames cut: the 9th step.
        assert ours[f"first_audio_step_b{batch}"] == 9
        assert ours[f"ttfd_ms_b{batch}"]["p50"] < ours[f"ttfa_ms_b{batch}"]["p50"]
        frame_s = ours[f"frame_ms_b{batch}"]["p50"] / 1000
        assert ours[f"audio_per_s_b{batch}"] == pytest.approx(batch * 0.08 / frame_s)
    assert ours["real_time_factor_b1"] == ours["audio_per_s_b1"]
    assert 0 < ours["peak_memory_gb"] < 2
    assert "ttfa_ms_b2" in done.stdout and "real-time factor" in done.stdout
    anatomy = ours["frame_anatomy"]
    assert 0 < anatomy["temporal_ops"] < anatomy["ops"] and anatomy["syncs"] == 1
    assert "us per op here" in done.stdout


def test_tts_layout_is_the_published_one():
    """The random TTS file's names, shapes and dtypes for the fixture's config are those of
    tests/fixtures/tts/weights.safetensors (written by Kyutai's PyTorch model)."""
    from moshi_mlx.checkpoints.io import read_safetensors
    from moshi_mlx.testing.checkpoints import tts_pytorch_layout

    fixtures = ROOT / "tests" / "fixtures" / "tts"
    layout = tts_pytorch_layout(json.loads((fixtures / "config.json").read_text()))
    published = read_safetensors(fixtures / "weights.safetensors").layout
    assert layout == published
    # The bench's shapes are keyed as the published config.json (the fixture's order).
    fixture_keys = list(json.loads((fixtures / "config.json").read_text()))
    for shape in _bench_module("shapes").TTS_SHAPES.values():
        assert list(shape) == fixture_keys[: len(shape)]


def test_voice_writer_rewrites_the_tts_fixture_voices(tmp_path):
    """`write_voice` (what scripts/make_tts_fixtures.py and the bench write voices with) gives
    the committed fixture voices byte for byte, from the fixture script's generator."""
    from moshi_mlx.testing.voices import random_voice, write_voice

    fixtures = ROOT / "tests" / "fixtures" / "tts"
    model_id = json.loads((fixtures / "config.json").read_text())["model_id"]
    metadata = {key: str(value) for key, value in model_id.items()}
    rng = np.random.default_rng(21)
    for name in ("alice", "bob"):
        voice = random_voice(rng, 16, 10)
        path = write_voice(tmp_path / f"{name}.safetensors", voice, metadata)
        assert path.read_bytes() == (fixtures / "voices" / f"{name}.safetensors").read_bytes()


def test_serve_case(tmp_path):
    """The serve part on its smallest settings: a real `python -m moshi_mlx serve` on tiny
    models, one first-audio run, 10-frame live streams alone and beside an LLM answer, no
    transcription (`--warmup 1`)."""
    flags = "--parts serve --frames 10 --warmup 1"
    done, report = _run_bench(flags, tmp_path / "serve.json", timeout=120)
    (case,) = report["results"]
    ours = case["ours"]
    _check_timing(ours["first_audio_ms"], 1)
    for stream in ("stt", "tts"):
        count = ours["stt_steps"] if stream == "stt" else ours["tts_frames"]
        for metric in (f"{stream}_lag_ms", f"{stream}_lag_with_llm_ms"):
            _check_timing(ours[metric], count)
        assert ours[f"{stream}_lag_added_by_llm_ms"] == pytest.approx(
            ours[f"{stream}_lag_with_llm_ms"]["p50"] - ours[f"{stream}_lag_ms"]["p50"]
        )
        assert ours[f"llm_chunks_beside_{stream}"] > 0  # the LLM did run beside the stream
    assert ours["stt_steps"] == 10 and ours["tts_frames"] > 0
    assert "transcriptions" not in ours
    assert "first_audio_ms" in done.stdout and "LLM lag added" in done.stdout


def test_assistant_case(tmp_path):
    """The assistant part on one turn: the real pipeline on the tiny STT, TTS and LLM, the
    split of the turn, the parts alone, and the orchestration's own time (the window from
    the end of the turn to the first audio less the model calls in it)."""
    done, report = _run_bench("--parts assistant --turns 1", tmp_path / "a.json", timeout=180)
    (case,) = report["results"]
    ours = case["ours"]
    (turn,) = ours["turns"]
    stages = ("detection", "stt_flush", "llm_first_token", "tts_first_audio", "audio_out")
    assert all(turn[stage] >= 0 for stage in stages)
    assert turn["total"] == pytest.approx(sum(turn[stage] for stage in stages))
    assert turn["window"] == pytest.approx(
        turn["stt_flush"] + turn["llm_first_token"] + turn["tts_first_audio"]
    )
    assert 0 < turn["model_busy"] <= turn["window"]
    assert turn["overhead"] == pytest.approx(turn["window"] - turn["model_busy"])
    for alone in ("stt_flush_alone", "llm_first_token_alone", "tts_first_audio_alone"):
        assert turn[alone] > 0
    assert ours["frame_ms"] >= 80 and ours["stt_step_ms"] > 0 and ours["tts_frame_ms"] > 0
    assert "orchestration overhead: median" in done.stdout


def test_realtime_case(tmp_path):
    """The realtime part on one turn: `/v1/realtime`'s connection and session over the tiny
    models through a loopback websocket; the turn's milestones from the client's clock, the
    engine's split, and the socket and event layer's time per audio delta and per Moshi
    frame there and back (under 5 ms)."""
    done, report = _run_bench("--parts realtime --turns 1", tmp_path / "r.json", timeout=400)
    (case,) = report["results"]
    ours = case["ours"]
    (turn,) = ours["turns"]
    assert 0 < turn["speech_stopped"] < turn["first_audio_delta"]
    stages = ("detection", "stt_flush", "llm_first_token", "tts_first_audio", "audio_out")
    assert all(turn[stage] >= 0 for stage in stages)
    assert ours["deltas"] > 0 and 0 <= ours["socket_ms_median"] < 5.0
    assert turn["first_frame_to_client"] >= 0
    layer = case["duplex_layer"]  # Moshi's frame there and back through the socket, no model
    assert 0 < layer["round_trip_ms_median"] < 5.0
    moshi = case["moshi"]  # the tiny Moshi through the socket, one frame at a time
    assert moshi["frames"] > 0 and 0 < moshi["step_ms_median"] <= moshi["round_trip_ms_median"]
    assert "socket and event layer" in done.stdout and "Moshi full duplex" in done.stdout


PART_NAMES = {
    "lm", "mimi", "pipeline", "echo", "ops", "web", "kv", "kv-fidelity", "persona", "stt", "tts",
    "serve", "assistant", "realtime",
}  # fmt: skip


def test_every_part_is_registered():
    """One registry entry per part, in the order a run measures them, each from its own
    module, and `--parts` takes exactly the registered names."""
    parts = _bench_module("parts").PARTS
    assert set(parts) == PART_NAMES
    assert list(parts)[:4] == ["lm", "mimi", "pipeline", "echo"] and list(parts)[-1] == "web"
    for name, part in parts.items():
        assert part.name == name
        assert part.cases.__module__.startswith("bench.parts.")
    args = _bench_module("cli").parse_args(["--parts", ",".join(sorted(PART_NAMES))])
    assert set(args.parts) == PART_NAMES


@pytest.mark.parametrize("flags", [["--parts", "lm,nope"], ["--shapes", "huge"]])
def test_an_unknown_name_is_a_one_line_error(flags):
    command = [sys.executable, str(SCRIPTS / "bench.py"), *flags]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert f"error: {flags[0]}: unknown {flags[1].split(',')[-1]} (known: " in line


def test_the_package_runs_as_a_folder_and_as_a_module():
    """`python scripts/bench` and `python -m bench` (from scripts/) are `scripts/bench.py`."""
    outputs = []
    for command, cwd in (
        ([sys.executable, str(SCRIPTS / "bench.py"), "--floor"], ROOT),
        ([sys.executable, str(SCRIPTS / "bench"), "--floor"], ROOT),
        ([sys.executable, "-m", "bench", "--floor"], SCRIPTS),
    ):
        run = {"cwd": cwd, "capture_output": True, "text": True, "timeout": 120}
        done = subprocess.run(command, check=False, **run)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1] == outputs[2]
    # Moshi 7B q4 reads 4.61 GB of weights and 1.57 GB of KV cache a step: 90.9 ms on an M1.
    assert "| Moshi 7B q4 | 4.61 | 1.57 |" in outputs[0] and "M1 68 GB/s" in outputs[0]
    assert "| 90.9 / " in outputs[0]


def test_gpu_suite_on_tiny_shapes(tmp_path):
    """`--suite gpu --tiny` runs every figure end to end into one JSON file, each with its
    flags, its cases and the numbers it is for."""
    suite = _bench_module("suite")
    out = tmp_path / "gpu.json"
    command = [
        sys.executable,
        str(SCRIPTS / "bench.py"),
        "--suite",
        "gpu",
        "--tiny",
        "-o",
        str(out),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["suite"], report["shapes"]) == ("gpu", "tiny")
    assert set(_bench_module("cli").SUITES) == set(suite.SUITES)
    figures = report["figures"]
    assert list(figures) == [figure.name for figure in suite.GPU_SUITE]
    for name, entry in figures.items():
        assert "error" not in entry, (name, entry.get("error"))
        assert entry["results"] and entry["summary"]
        for key, value in entry["summary"].items():
            if isinstance(value, float):
                assert math.isfinite(value) and value > 0, (name, key)
    realtime = figures["realtime_latency"]["summary"]
    assert realtime["moshi_shape"] == "tiny" and realtime["moshi_round_trip_ms_median"] > 0
    assert 0 < realtime["speech_stopped_ms_median"] < realtime["first_audio_delta_ms_median"]
    step = figures["moshi_7b_q4_step"]["summary"]
    assert 0 < step["host_ms_p50"] <= step["step_ms_p95"] and step["syncs_per_step"] == 1.0
    stt = figures["stt_batch_8_vs_1"]["summary"]
    assert stt["streams"] == 2 and stt["full_speedup"] > 0 and stt["start_step_ms_2"] > 0
    persona = figures["personaplex_prefill_300"]["summary"]
    assert persona["prompt_runs"] == 40 and persona["prefill_steps"] > 0
    tts = figures["tts_real_time_factor"]["summary"]
    for quant in ("bf16", "q8", "q4"):
        rtf, audio_b2 = tts[f"{quant}_real_time_factor_b1"], tts[f"{quant}_audio_per_s_b2"]
        assert rtf == tts[f"{quant}_audio_per_s_b1"] > 0 and audio_b2 > 0
    assert figures["moshi_7b_q4_frame"]["summary"]["syncs_per_frame"] == 1.0


@needs_kyutai
def test_gpu_suite_beside_kyutai_on_tiny_shapes(tmp_path):
    """`--suite gpu --kyutai` measures Kyutai's TTS, STT and Moshi steps beside ours, each
    summary with Kyutai's p50s and ours over them."""
    out = tmp_path / "gpu.json"
    command = [sys.executable, str(SCRIPTS / "bench.py"), "--suite", "gpu", "--tiny", "--kyutai"]
    command += ["-o", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())["figures"]
    assert all("error" not in entry for entry in figures.values())
    for name in ("moshi_7b_q4_step", "stt_1b_step"):
        summary = figures[name]["summary"]
        assert summary["kyutai_step_ms_p50"] > 0 and summary["step_ms_over_kyutai"] > 0
        assert "--kyutai" in figures[name]["flags"]
    tts = figures["tts_real_time_factor"]["summary"]
    assert tts["bf16_step_ms_b1_over_kyutai"] > 0 and "q8_step_ms_b1_over_kyutai" not in tts
    assert "--kyutai" not in figures["moshi_7b_q4_frame"]["flags"]
