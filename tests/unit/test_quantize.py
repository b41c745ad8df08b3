"""The converter / quantizer (moshi_mlx.quantize, moshi_mlx.checkpoints.quantize): published layouts, fidelity, CLI, crash safety.

Source model: the tiny reference LM of tests/fixtures/lm (PyTorch-initialised weights), given in
both of Kyutai's namings.
"""

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import KYUTAI_PYTHON, MANIFESTS, needs_kyutai
from mlx import nn
from safetensors import safe_open
from tiny_moshi import (
    cached_tiny_moshi,
    cached_tiny_stt,
    espeak_speech,
    load_tiny_stt,
    tiny_stt_config,
    write_tiny_stt,
)

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.chat.check import compare_generation
from moshi_mlx.checkpoints.conversion import convert_shapes, to_pytorch_naming
from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.checkpoints.spec import LM_FILES, output_layout
from moshi_mlx.cli.quantize import main
from moshi_mlx.models.config import MOSHI_DELAYS, LmConfig
from moshi_mlx.runtime.codec import FRAME_SIZE
from moshi_mlx.stt.stepper import SttStepper
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.testing.checkpoints import load_lm, write_random_lm_checkpoint

LM_FIXTURES = Path(__file__).parents[1] / "fixtures" / "lm"
KYUTAI_CONFIGS = Path(__file__).parents[1] / "fixtures" / "kyutai_configs"
CONFIG = LmConfig.tiny()  # the fixture's config (checked in test_lm_parity.py)
SAFETENSORS_DTYPES = {"BF16": mx.bfloat16, "U32": mx.uint32}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The tiny reference LM as bf16 files in MLX and in PyTorch naming: {"mlx" | "pytorch"}."""
    root = tmp_path_factory.mktemp("quantize_sources")
    weights = mx.load(str(LM_FIXTURES / "weights.safetensors"))
    paths = {}
    for naming, tensors in (("mlx", weights), ("pytorch", to_pytorch_naming(weights))):
        (root / naming).mkdir()
        paths[naming] = root / naming / "model.safetensors"
        mx.save_safetensors(str(paths[naming]), tensors)
        shutil.copy(LM_FIXTURES / "config.json", root / naming / "config.json")
    return paths


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """Outputs for each (naming, bits), converted once."""
    root = tmp_path_factory.mktemp("quantize_outputs")
    return {
        (naming, bits): quantize_checkpoint(
            sources[naming], root / f"{naming}.{bits}.safetensors", bits=bits
        ).output
        for naming in ("mlx", "pytorch")
        for bits in (4, 8, 16)
    }


def read_layout(path: Path) -> tuple[dict[str, tuple[tuple[int, ...], mx.Dtype]], dict]:
    """Names, shapes, dtypes and metadata of a safetensors file, read by the reference library."""
    with safe_open(str(path), "np") as file:
        layout = {}
        for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
            info = file.get_slice(name)
            layout[name] = (tuple(info.get_shape()), SAFETENSORS_DTYPES[info.get_dtype()])
        return layout, file.metadata()


def manifest_names(name: str) -> set[str]:
    """The tensor names a manifest lists (Kyutai's MLX names of a tiny model's parameters)."""
    with (MANIFESTS / f"{name}.tsv").open() as file:
        return {row["name"] for row in csv.DictReader(file, delimiter="\t")}


def read_manifest(name: str) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    path = MANIFESTS / f"{name}.tsv"
    with path.open() as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    dtypes = {"bfloat16": mx.bfloat16, "uint32": mx.uint32}
    return {
        row["name"]: (tuple(int(d) for d in row["shape"].split(",")), dtypes[row["dtype"]])
        for row in rows
    }


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_7b_output_layouts_equal_the_published_files(bits):
    pytorch = read_manifest("moshiko_pytorch_bf16")
    mlx_shapes = convert_shapes({name: shape for name, (shape, _) in pytorch.items()})
    name = {4: "moshiko_mlx_q4", 8: "moshiko_mlx_q8", 16: "moshiko_mlx_bf16"}[bits]
    group_size = {4: 32, 8: 64, 16: None}[bits]
    assert output_layout(mlx_shapes, bits, group_size) == read_manifest(name)


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_quantized_files_have_kyutai_layout_and_load_strictly(converted, bits, group_size):
    path = converted[("mlx", bits)]
    layout, metadata = read_layout(path)
    assert metadata["quantization_bits"] == str(bits)
    assert metadata["quantization_group_size"] == str(group_size)
    float_shapes = {n: s for n, (s, _) in read_layout(converted[("mlx", 16)])[0].items()}
    assert layout == output_layout(float_shapes, bits, group_size)
    # Every Linear / Embedding of the tiny model has a width divisible by 32 and 64.
    assert sum(name.endswith(".scales") for name in layout) == 2 + 16 + 2 * 4 + 8 * (3 + 2 * 4)
    assert layout["text_linear.weight"] == ((100, 64 * bits // 32), mx.uint32)
    assert layout["out_norm.weight"] == ((64,), mx.bfloat16)
    lm = load_lm(path, CONFIG)
    assert isinstance(lm.text_linear, nn.QuantizedLinear)
    assert (lm.text_linear.bits, lm.text_linear.group_size) == (bits, group_size)
    assert isinstance(lm.depformer.slices[5].emb, nn.QuantizedEmbedding)


def test_pytorch_named_input_gives_the_same_model(converted, sources):
    for bits in (4, 8, 16):
        from_mlx = mx.load(str(converted[("mlx", bits)]))
        from_pytorch = mx.load(str(converted[("pytorch", bits)]))
        assert from_mlx.keys() == from_pytorch.keys()
        for name, array in from_mlx.items():
            assert mx.array_equal(array, from_pytorch[name]).item(), (bits, name)
    # Same logits: the PyTorch-named source against the bf16 file made from the MLX-named one.
    check = compare_generation(sources["pytorch"], converted[("mlx", 16)], CONFIG, steps=12)
    assert check.text_agreement == check.audio_agreement == 1.0
    assert check.max_text_logit_diff == check.max_audio_logit_diff == 0.0


def test_quantized_generation_tracks_the_bf16_model(converted, sources):
    """Figures (tiny reference model, 32 greedy steps, teacher-forced on the inputs `ChatStepper`
    fed the bf16 model, float32 compute on the CPU): q8 agrees on 96.9% of text and 97.3% of
    audio tokens, max |logit difference| 0.10 / 0.08, relative RMS logit error 0.021; q4 on
    75.0% / 66.4%, 0.93 / 0.95, 0.26. (Before the check drove `LmGen` (now `ChatStepper`), its own copy of the
    delays fed Moshi's generated codebooks `delay` steps late: 96.9% / 97.3%, 0.023 for q8 and
    59.4% / 68.8%, 0.27 for q4 on that stream.)
    The tiny random model's logits are nearly flat (RMS 1.0 over 100 text tokens, 0.68 over
    64 audio codes), so near-ties flip under q4's 7% weight error: a worst case for agreement."""
    checks = {
        bits: compare_generation(sources["mlx"], converted[("mlx", bits)], CONFIG, steps=32)
        for bits in (4, 8)
    }
    for bits, check in checks.items():
        print(f"q{bits}", check.summary())
    q4, q8 = checks[4], checks[8]
    assert q8.text_agreement >= 0.85 and q8.audio_agreement >= 0.85
    assert q4.text_agreement >= 0.5 and q4.audio_agreement >= 0.55
    assert 0 < q8.relative_logit_error < 0.08
    assert 0 < q4.relative_logit_error < 0.4
    assert q8.relative_logit_error < q4.relative_logit_error / 4
    assert q8.max_text_logit_diff < q4.max_text_logit_diff / 3
    assert q8.max_audio_logit_diff < q4.max_audio_logit_diff / 3
    assert q8.max_text_logit_diff < 0.25 * q8.text_logit_rms


def test_error_report_lists_groups_and_worst_layers(sources, tmp_path):
    errors = {}
    for bits in (4, 8):
        result = quantize_checkpoint(sources["mlx"], tmp_path / f"q{bits}.safetensors", bits)
        errors[bits] = result.relative_errors
        report = result.error_report(worst=3)
        assert "transformer.layers.*.self_attn.in_proj" in report
        assert "depformer.slices.*.transformer.layers.*.gating.linear_out" in report
        assert report.splitlines()[-1].startswith("worst layers: ")
        assert report.splitlines()[-1].count(", ") == 2
    assert len(errors[4]) == 2 + 16 + 2 * 4 + 8 * (3 + 2 * 4)  # every Linear and Embedding
    assert not any("norm" in name for name in errors[4])
    # Affine quantization of uniform/Gaussian weights: about 7-8% (4 bits), 0.5-1% (8 bits).
    assert all(0.05 < error < 0.1 for error in errors[4].values())
    assert all(0.003 < error < 0.012 for error in errors[8].values())


def test_group_size_override_is_recorded_and_honoured(sources, tmp_path):
    output = tmp_path / "q4g64.safetensors"
    assert main([str(sources["mlx"]), "-o", str(output), "--bits", "4", "--group-size", "64"]) == 0
    layout, metadata = read_layout(output)
    assert metadata["quantization_group_size"] == "64"
    assert layout["text_emb.scales"] == ((101, 1), mx.bfloat16)
    lm = load_lm(output, CONFIG)
    assert lm.text_emb.group_size == 64


def test_cli_refuses_a_hard_link_to_the_input_even_with_force(sources, tmp_path, capsys):
    link = tmp_path / "link.safetensors"
    os.link(sources["mlx"], link)
    kept = link.read_bytes()
    assert main([str(sources["mlx"]), "-o", str(link), "--force", "--bits", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "overwrite the input" in err, err
    assert link.read_bytes() == kept and [p.name for p in tmp_path.iterdir()] == [link.name]


def test_cli_refuses_to_overwrite_and_reports_user_errors_in_one_line(sources, tmp_path, capsys):
    output = tmp_path / "out.safetensors"
    output.write_bytes(b"keep me")
    assert main([str(sources["mlx"]), "-o", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "--force" in err
    assert output.read_bytes() == b"keep me"
    assert main([str(sources["mlx"]), "-o", str(output), "--force"]) == 0
    assert read_layout(output)[1]["quantization_bits"] == "4"
    capsys.readouterr()

    not_moshi = tmp_path / "not_moshi.safetensors"
    mx.save_safetensors(str(not_moshi), {"encoder.weight": mx.zeros((4, 4))})
    cases = [
        ([str(not_moshi)], "expected either Kyutai's PyTorch naming (out_norm.alpha"),
        ([str(tmp_path / "missing.safetensors")], "weights file not found"),
        ([str(sources["mlx"]), "-o", str(sources["mlx"]), "--bits", "16"], "overwrite the input"),
        ([str(output), "-o", str(tmp_path / "again.safetensors")], "already quantized"),
        ([str(sources["mlx"]), "-o", str(tmp_path / "no" / "q4.safetensors")], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "not_moshi.safetensors",
        "out.safetensors",
    ]


def test_progress_bar_and_check_from_the_cli(sources, tmp_path, capsys):
    output = tmp_path / "q8.safetensors"
    argv = [str(sources["pytorch"]), "-o", str(output), "--bits", "8", "--progress"]
    assert main([*argv, "--check", "--check-steps", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.err.rstrip("\n").endswith(tuple(f"{s}" for s in range(10)))  # elapsed m:ss
    assert "100%" in captured.err and "151/151 tensors" in captured.err
    assert "from pytorch-named input" in captured.out and "peak memory" in captured.out
    assert "check over 4 greedy steps" in captured.out


def test_check_with_a_config_that_does_not_fit_stops_before_converting(sources, tmp_path, capsys):
    config = json.loads((LM_FIXTURES / "config.json").read_text())
    config["num_layers"] += 1
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(config))
    output = tmp_path / "q8.safetensors"
    argv = [str(sources["pytorch"]), "-o", str(output), "--check", "--config", str(wrong)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "missing tensor(s)" in captured.err
    assert "--check needs the config.json of these weights" in captured.err
    assert captured.out == "" and not output.exists()


# A model large enough for the conversion to take a few seconds (about 80 M parameters).
MEDIUM = LmConfig(
    dim=512,
    num_heads=8,
    num_layers=6,
    hidden_scale=4.125,
    context=16,
    depformer_dim=256,
    depformer_num_heads=4,
    depformer_num_layers=2,
    depformer_dim_feedforward=1056,
    card=2048,
    text_card=32000,
    n_q=16,
    dep_q=8,
    delays=MOSHI_DELAYS,
)


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory) -> Path:
    return write_random_lm_checkpoint(tmp_path_factory.mktemp("medium"), MEDIUM, seed=1)


def test_a_killed_conversion_leaves_no_output(medium_checkpoint, tmp_path):
    output = tmp_path / "model.q4.safetensors"
    command = [sys.executable, "-m", "moshi_mlx", "quantize", str(medium_checkpoint)]
    process = subprocess.Popen(
        [*command, "-o", str(output), "--progress"], stderr=subprocess.PIPE, text=False
    )
    # The bar is drawn after each converted tensor: kill as soon as the first one is written.
    first = process.stderr.read(1)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert first == b"\r" and process.returncode == -signal.SIGKILL
    assert not output.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".model.q4.safetensors."), leftovers
    # The next conversion to that name removes the dead process's temporary file.
    assert main([str(medium_checkpoint), "-o", str(output), "--bits", "16"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [output.name]


def test_ctrl_c_ends_a_conversion_cleanly(medium_checkpoint, tmp_path):
    output = tmp_path / "model.q4.safetensors"
    command = [sys.executable, "-m", "moshi_mlx", "quantize", str(medium_checkpoint)]
    process = subprocess.Popen(
        [*command, "-o", str(output), "--progress"], stderr=subprocess.PIPE, text=False
    )
    first = process.stderr.read(1)  # the first converted tensor's progress bar
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert first == b"\r" and process.returncode == 130, err
    assert err.decode().rstrip().endswith("interrupted") and b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a partial file


def test_peak_memory_stays_far_below_the_model_size(medium_checkpoint, tmp_path):
    size = medium_checkpoint.stat().st_size
    largest = max(a.nbytes for a in mx.load(str(medium_checkpoint)).values())
    result = quantize_checkpoint(medium_checkpoint, tmp_path / "q4.safetensors", bits=4)
    print(result.summary(), f"(input {size / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB)")
    assert result.peak_mlx_bytes < largest + 96 * 2**20
    assert result.peak_mlx_bytes < 0.75 * size
    assert np.isclose(
        result.output_bytes, output_size := (tmp_path / "q4.safetensors").stat().st_size
    )
    assert output_size < 0.35 * size


_KYUTAI_SCRIPT = """
import json, sys
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from moshi_mlx import models

cfg = models.LmConfig.from_config_dict(json.load(open(sys.argv[1])))
sums = {}
for path, bits, group_size in json.loads(sys.argv[2]):
    model = models.Lm(cfg)
    model.set_dtype(mx.bfloat16)
    if bits != 16:
        nn.quantize(model, bits=bits, group_size=group_size)
    model.load_weights(path, strict=True)
    sums[path] = {
        name: mx.sum(p.astype(mx.uint64 if p.dtype == mx.uint32 else mx.float32)).item()
        for name, p in tree_flatten(model.parameters())
    }
print(json.dumps(sums))
"""


def _add_published_depformer_keys(config_file: Path) -> None:
    """Give an STT config.json the depformer keys of Kyutai's published STT config."""
    published = json.loads((KYUTAI_CONFIGS / "stt-1b-en_fr-mlx.json").read_text())
    depformer = {key: value for key, value in published.items() if key.startswith("depformer_")}
    config_file.write_text(json.dumps(depformer | json.loads(config_file.read_text())))


@needs_kyutai
@pytest.mark.parametrize("model", ["moshi", "stt"])
def test_outputs_load_strictly_in_kyutai_moshi_mlx(tmp_path, model):
    """Kyutai's own loader (moshi_mlx 0.3.0 on mlx 0.26.5: `nn.quantize` then
    `load_weights(strict=True)`) reads our q4/q8/bf16 files, with the same data: Moshi's, and
    STT's, whose voice-activity heads it quantizes as it does every Linear."""
    # Kyutai's MLX model sizes the FFN as 11 * dim / 4 whatever hidden_scale says; 4.125 agrees.
    tiny = {"moshi": CONFIG, "stt": tiny_stt_config()}[model]
    config = replace(tiny, dim=256, hidden_scale=4.125)
    source = write_random_lm_checkpoint(tmp_path, config, seed=3, write_config=True)
    if model == "stt":  # Kyutai's reader wants the depformer keys (unused with dep_q 0) that
        _add_published_depformer_keys(tmp_path / "config.json")  # our config.json leaves out
    outputs = [
        (
            str(quantize_checkpoint(source, tmp_path / f"out{bits}.safetensors", bits).output),
            bits,
            group_size,
        )
        for bits, group_size in ((4, 32), (8, 64), (16, None))
    ]
    arguments = [str(tmp_path / "config.json"), json.dumps(outputs)]
    # In tmp_path and without our PYTHONPATH, so that Kyutai's moshi_mlx is imported, not ours.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    run = subprocess.run(
        [str(KYUTAI_PYTHON), "-c", _KYUTAI_SCRIPT, *arguments],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    kyutai_sums = json.loads(run.stdout)
    for path, _, _ in outputs:
        ours = mx.load(path)
        assert kyutai_sums[path].keys() == ours.keys()
        for name, array in ours.items():
            if array.dtype == mx.uint32:
                assert kyutai_sums[path][name] == mx.sum(array.astype(mx.uint64)).item(), name
            else:
                expected = mx.sum(array.astype(mx.float32)).item()
                assert np.isclose(kyutai_sums[path][name], expected, rtol=1e-5), name


@pytest.mark.parametrize("bits", [4, 16])
def test_hibiki_converts_with_kyutai_mlx_names_and_float_condition_tables(tmp_path, bits):
    """Hibiki's PyTorch file (conditioner in float32) converts to Kyutai's MLX names; the
    condition tables, 16 wide, stay bf16 (no group divides them) and the output loads with its
    text embedding's row 2 := row 3 (Kyutai's Hibiki rule, applied at load)."""
    hibiki = Path(__file__).parents[1] / "fixtures" / "hibiki"
    output = tmp_path / "model.safetensors"
    quantize_checkpoint(hibiki / "weights.safetensors", output, bits=bits)
    tensors = mx.load(str(output))
    names = manifest_names("hibiki_tiny_mlx_names")
    assert {n for n in tensors if not n.endswith((".scales", ".biases"))} == names
    for name in names:
        if name.startswith("condition_provider."):
            assert tensors[name].dtype == mx.bfloat16, name
    assert (bits == 4) == ("text_emb.scales" in tensors)
    lm = load_lm(output, LmConfig.from_dict(json.loads((hibiki / "config.json").read_text())))
    rows = lm.text_emb(mx.array([2, 3]))
    assert mx.array_equal(rows[0], rows[1]).item()


@pytest.fixture(scope="module")
def tiny_stt(tmp_path_factory) -> dict[str, Path]:
    """A tiny random STT checkpoint (PyTorch naming, as kyutai/stt-1b-en_fr) whose every
    layer is 64 or 128 wide, so that q8's groups of 64 divide them all, with the random
    full-size Mimi and a tokenizer."""
    moshi = cached_tiny_moshi(tmp_path_factory)
    config = replace(tiny_stt_config(), dim=64, hidden_scale=3.0)  # FFN hidden width 128
    root = tmp_path_factory.mktemp("tiny_stt_64")
    return write_tiny_stt(root, moshi["mimi"], moshi["tokenizer"], config)


def _speech_codes(model: SttModel, speech: np.ndarray) -> list[mx.array]:
    """Mimi's codes (1, n_q) of `speech` and of the silence `transcribe` flushes it with."""
    steps = math.ceil(len(speech) / FRAME_SIZE) + model.speech_to_text().flush_steps
    padded = np.zeros(steps * FRAME_SIZE, np.float32)
    padded[: len(speech)] = speech
    codec = model.codec.fresh()
    return [codec.encode_step(frame).reshape(1, -1) for frame in padded.reshape(steps, -1)]


def _listen(model: SttModel, codes: list[mx.array]) -> dict[str, np.ndarray]:
    """The greedy text tokens (T,), text logits (T, text_card) and voice-activity head
    probabilities (T, heads, classes) of `model` stepping over `codes`."""
    stepper = SttStepper(model.lm)
    steps = [stepper.step(frame) for frame in codes]
    return {
        "tokens": np.array(mx.concatenate([step.text for step in steps])),
        "logits": np.array(mx.concatenate([step.text_logits for step in steps])),
        "heads": np.array(mx.concatenate([step.head_probabilities for step in steps])),
    }


def _stt_fidelity(quantized: dict[str, np.ndarray], source: dict[str, np.ndarray]) -> dict:
    """Token agreement over every step; logit and head errors over the steps before the first
    disagreement (after it, the text token fed back differs and so do the inputs)."""
    agree = quantized["tokens"] == source["tokens"]
    same_inputs = int(np.argmin(agree)) + 1 if not agree.all() else len(agree)
    diff = quantized["logits"][:same_inputs] - source["logits"][:same_inputs]
    rms = float(np.sqrt(np.mean(np.square(source["logits"][:same_inputs]))))
    heads = quantized["heads"][:same_inputs] - source["heads"][:same_inputs]
    return {
        "agreement": float(agree.mean()),
        "same_inputs": same_inputs,
        "relative_logit_error": float(np.sqrt(np.mean(np.square(diff)))) / rms,
        "max_head_diff": float(np.abs(heads).max()),
    }


def test_stt_quantizes_to_kyutai_mlx_names_and_transcribes_with_its_heads(tiny_stt, tmp_path):
    """The tiny STT in PyTorch naming to q8 and q4: Kyutai's MLX names; every Linear and
    Embedding quantized, the voice-activity heads (`extra_heads`) included, as Kyutai's loader
    expects (`nn.quantize` of the whole model; test_outputs_load_strictly_in_kyutai_moshi_mlx);
    loads strictly with its 4 heads, and transcribes.
    Figures (espeak-ng speech of 2.6 s and its flush, 52 greedy steps, float32 compute on the
    CPU): q8 gives the float model's text token at every step, its text logits within 1.2%
    relative RMS and its head probabilities within 0.012; q4 agrees on 69% of the steps (the
    first difference at step 5; logits within 21% before it)."""
    speech_file = espeak_speech(
        tmp_path / "speech.wav", "Can you hear me? Tell me about the weather."
    )
    if speech_file is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    source_model = load_tiny_stt(tiny_stt)
    codes = _speech_codes(source_model, read_audio(speech_file))
    source = _listen(source_model, codes)
    names = manifest_names("stt_tiny_mlx_names")
    layers = {name.removesuffix(".weight") for name in names if "norm" not in name}
    fidelity = {}
    for bits in (8, 4):
        output = tmp_path / LM_FILES[bits][1]
        quantize_checkpoint(tiny_stt["moshi"], output, bits=bits)
        tensors = mx.load(str(output))
        assert {n for n in tensors if not n.endswith((".scales", ".biases"))} == names
        assert {n.removesuffix(".scales") for n in tensors if n.endswith(".scales")} == layers
        model = load_tiny_stt({**tiny_stt, "moshi": output})
        heads = model.lm.extra_heads
        assert len(heads) == 4 and all(isinstance(h, nn.QuantizedLinear) for h in heads)
        assert {h.bits for h in heads} == {bits}
        fidelity[bits] = _stt_fidelity(_listen(model, codes), source)
        print(f"q{bits}", fidelity[bits])
    q8, q4 = fidelity[8], fidelity[4]
    assert (source["tokens"] != 3).any()  # the float model writes text, not only padding
    assert q8["agreement"] >= 0.85 and q8["same_inputs"] >= 10
    assert q8["relative_logit_error"] < 0.04 and q8["max_head_diff"] < 0.05
    assert q4["agreement"] >= 0.5
    assert q8["relative_logit_error"] < q4["relative_logit_error"] / 4


def test_a_model_with_nothing_to_quantize_is_refused(tmp_path_factory, tmp_path, capsys):
    """The 32-wide tiny STT at q8: no width divides by 64, so no file (its metadata would
    declare a quantization that no tensor has, which no loader reads)."""
    files = cached_tiny_stt(tmp_path_factory)
    output = tmp_path / "model.q8.safetensors"
    assert main([str(files["moshi"]), "-o", str(output), "--bits", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no layer's input width divides by the group size 64" in err
    assert not output.exists()
